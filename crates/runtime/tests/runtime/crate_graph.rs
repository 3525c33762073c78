//! The crate graph of ARCHITECTURE.md ("Crate graph") holds: `cargo metadata` gives each
//! workspace crate's normal and build dependencies, and no crate reaches, directly or
//! through others, a crate its "never depends on" line names; the server's own
//! `Cargo.toml` names none of the crates only the runtime may assemble a model from. The
//! graph drawn in ARCHITECTURE.md is the one `cargo metadata` gives, and every "never
//! depends on" line there is in the table checked here.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

/// Crate → the crates it must never reach, transitively (names without `lockstep-`).
const NEVER: &[(&str, &[&str])] = &[
    ("gguf", &["*"]),
    ("quant", &["*"]),
    ("hub", &["*"]),
    ("chat", &["*"]),
    ("sampling", &["*"]),
    ("backend-cpu", &["*"]),
    (
        "text",
        &["model", "quant", "hub", "chat", "engine", "server"],
    ),
    ("grammar", &["model", "engine", "server", "runtime", "cli"]),
    ("model", &["text", "chat", "grammar", "engine", "server"]),
    (
        "spec",
        &[
            "engine",
            "server",
            "runtime",
            "cli",
            "backend-cuda",
            "grammar",
        ],
    ),
    (
        "engine",
        &[
            "server",
            "runtime",
            "cli",
            "backend-cuda",
            "hub",
            "chat",
            "grammar",
        ],
    ),
    ("runtime", &["server", "cli", "backend-cuda"]),
    ("server", &["cli", "backend-cuda"]),
    (
        "backend-cuda",
        &[
            "engine", "spec", "grammar", "text", "server", "runtime", "cli", "hub", "chat",
        ],
    ),
];

/// Crate → crates its own `Cargo.toml` must not name (they may be reached through others).
const NEVER_DIRECT: &[(&str, &[&str])] = &[(
    "server",
    &[
        "model",
        "quant",
        "gguf",
        "hub",
        "backend-cpu",
        "backend-cuda",
    ],
)];

/// The workspace's crates and their direct normal/build dependencies on each other.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata is JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let short = |name: &str| name.strip_prefix("lockstep-").unwrap_or(name).to_string();
    let members: BTreeSet<String> = packages
        .iter()
        .filter_map(|p| p["name"].as_str())
        .map(short)
        .collect();
    packages
        .iter()
        .map(|p| {
            let name = short(p["name"].as_str().expect("package name"));
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| d["kind"].is_null() || d["kind"] == "build")
                .filter_map(|d| d["name"].as_str())
                .map(short)
                .filter(|d| members.contains(d))
                .collect();
            (name, deps)
        })
        .collect()
}

/// Every crate `name` reaches, with one path to each.
fn reach(g: &BTreeMap<String, BTreeSet<String>>, name: &str) -> BTreeMap<String, Vec<String>> {
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut stack = vec![vec![name.to_string()]];
    while let Some(path) = stack.pop() {
        let last = path.last().expect("non-empty path").clone();
        for d in g.get(&last).into_iter().flatten() {
            if !seen.contains_key(d) {
                let mut p = path.clone();
                p.push(d.clone());
                seen.insert(d.clone(), p.clone());
                stack.push(p);
            }
        }
    }
    seen
}

#[test]
fn no_crate_reaches_a_crate_its_never_line_names() {
    let g = graph();
    let mut broken = Vec::new();
    for (name, never) in NEVER {
        assert!(g.contains_key(*name), "no crate {name} in the workspace");
        for (dep, path) in reach(&g, name) {
            if never.contains(&"*") || never.contains(&dep.as_str()) {
                broken.push(path.join(" → "));
            }
        }
    }
    assert!(broken.is_empty(), "forbidden edges:\n{}", broken.join("\n"));
}

#[test]
fn the_server_names_no_model_assembly_crate_itself() {
    let g = graph();
    for (name, never) in NEVER_DIRECT {
        let direct = g.get(*name).expect("the crate exists");
        let named: Vec<&String> = direct
            .iter()
            .filter(|d| never.contains(&d.as_str()))
            .collect();
        assert!(named.is_empty(), "{name} depends directly on {named:?}");
    }
}

#[test]
fn the_checker_follows_edges_through_other_crates() {
    // server names no model crate itself, yet reaches model through runtime: a "never"
    // rule on it would be caught, with the path.
    let g = graph();
    let reached = reach(&g, "server");
    assert!(
        reached.contains_key("model"),
        "server reaches model via the runtime"
    );
    assert_eq!(
        reached.get("runtime").map(Vec::as_slice),
        Some(&["server".to_string(), "runtime".to_string()][..])
    );
}

/// The arrows of ARCHITECTURE.md's crate graph (the code block under "### Crate graph"):
/// `name → a, b,` lines (a line without an arrow continues the one before), and
/// `x, y → (none)` for crates without lockstep dependencies.
fn documented_graph() -> BTreeMap<String, BTreeSet<String>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ARCHITECTURE.md");
    let doc = std::fs::read_to_string(&path).expect("ARCHITECTURE.md is readable");
    let section = doc
        .split_once("### Crate graph")
        .expect("ARCHITECTURE.md has a \"Crate graph\" section")
        .1;
    let block = section
        .split("```")
        .nth(1)
        .expect("the crate graph section has a code block");
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut current: Vec<String> = Vec::new();
    let list = |s: &str| -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(str::to_string)
            .collect()
    };
    for line in block.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let deps = match line.split_once('→') {
            Some((names, deps)) => {
                current = list(names);
                for n in &current {
                    assert!(
                        g.insert(n.clone(), BTreeSet::new()).is_none(),
                        "{n} has two lines"
                    );
                }
                deps
            }
            None => line,
        };
        if deps.trim() == "(none)" {
            continue;
        }
        for n in &current {
            g.get_mut(n)
                .expect("a line of the graph")
                .extend(list(deps));
        }
    }
    g
}

#[test]
fn the_documented_crate_graph_is_the_crate_graph() {
    // Every arrow in ARCHITECTURE.md is a dependency, and every dependency an arrow.
    let documented = documented_graph();
    let actual = graph();
    let mut wrong = Vec::new();
    for name in documented
        .keys()
        .chain(actual.keys())
        .collect::<BTreeSet<_>>()
    {
        let (d, a) = (documented.get(name), actual.get(name));
        if d != a {
            wrong.push(format!("{name}: documented {d:?}, Cargo.toml {a:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md's crate graph is wrong:\n{}",
        wrong.join("\n")
    );
}

/// Each crate section's "Never depends on:" names in ARCHITECTURE.md (the backticked names
/// up to the end of the clause; "any other lockstep crate" is `*`).
fn documented_never() -> BTreeMap<String, BTreeSet<String>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ARCHITECTURE.md");
    let doc = std::fs::read_to_string(&path).expect("ARCHITECTURE.md is readable");
    let mut out = BTreeMap::new();
    for section in doc.split("### `crates/").skip(1) {
        let Some((name, body)) = section.split_once('`') else {
            continue;
        };
        let body = body.split("\n## ").next().unwrap_or_default();
        let flat = body.split_whitespace().collect::<Vec<_>>().join(" ");
        let Some((_, clause)) = flat.split_once("Never depends on:") else {
            continue;
        };
        let end = [clause.find(';'), clause.find(". ")]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(clause.len());
        let clause = &clause[..end];
        let names: BTreeSet<String> = if clause.contains("any other lockstep crate") {
            ["*".to_string()].into()
        } else {
            clause
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect()
        };
        out.insert(name.to_string(), names);
    }
    out
}

#[test]
fn every_never_line_of_the_architecture_is_checked() {
    // What ARCHITECTURE.md promises, the NEVER table (at least) enforces.
    let documented = documented_never();
    assert!(
        documented.len() >= 10,
        "the never lines were not found: {documented:?}"
    );
    let members = graph();
    let mut unchecked = Vec::new();
    for (name, names) in &documented {
        let checked: BTreeSet<&str> = NEVER
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, never)| never.iter().copied().collect())
            .unwrap_or_default();
        for n in names {
            assert!(
                n == "*" || members.contains_key(n),
                "{name}'s never line names {n}, not a workspace crate"
            );
            if !checked.contains("*") && !checked.contains(n.as_str()) {
                unchecked.push(format!("{name} never depends on {n}"));
            }
        }
    }
    assert!(
        unchecked.is_empty(),
        "ARCHITECTURE.md promises what the test does not check:\n{}",
        unchecked.join("\n")
    );
}
