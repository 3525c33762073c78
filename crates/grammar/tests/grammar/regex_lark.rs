//! Regex, choice and Lark constraints: fixtures accepted/rejected, and random walks checked
//! by an independent engine (the `regex` crate, anchored).

use lockstep_grammar::Constraint;
use regex::Regex;

use crate::common::*;

/// The Codex `apply_patch` format.
pub const APPLY_PATCH: &str = r#"start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?
filename: /(.+)/
add_line: "+" /(.*)/ LF
change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF
LF: "\n"
"#;

/// The same language for the `regex` crate.
const APPLY_PATCH_RX: &str = concat!(
    r"\A\*\*\* Begin Patch\n(?:",
    r"\*\*\* Add File: [^\n]+\n(?:\+[^\n]*\n)+",
    r"|\*\*\* Delete File: [^\n]+\n",
    r"|\*\*\* Update File: [^\n]+\n(?:\*\*\* Move to: [^\n]+\n)?",
    r"(?:(?:(?:@@|@@ [^\n]+)\n|[+ \-][^\n]*\n)+(?:\*\*\* End of File\n)?)?",
    r")+\*\*\* End Patch\n?\z"
);

/// A relative file path: segments of safe characters separated by `/`.
pub const FILE_PATH: &str = r#"start: PATH
PATH: /[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*(\/[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*)*/
"#;
const FILE_PATH_RX: &str =
    r"\A[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*(/[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*)*\z";

struct RxCase {
    rx: &'static str,
    valid: &'static [&'static str],
    invalid: &'static [&'static str],
}

const REGEXES: &[RxCase] = &[
    RxCase {
        rx: r"[a-z]{3,8}",
        valid: &["abc", "abcdefgh"],
        invalid: &["ab", "abcdefghi", "ABC"],
    },
    RxCase {
        rx: r"\d{3}-\d{4}",
        valid: &["555-1234"],
        invalid: &["5551234", "55-1234"],
    },
    RxCase {
        rx: r"(foo|bar)+baz",
        valid: &["foobaz", "barfoobaz"],
        invalid: &["baz", "foobar"],
    },
    RxCase {
        rx: r"[A-Z][a-z]+( [A-Z][a-z]+)*",
        valid: &["Hello World"],
        invalid: &["hello", "Hello  World"],
    },
    RxCase {
        rx: r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
        valid: &["0", "-12.5"],
        invalid: &["01", "1."],
    },
    RxCase {
        rx: r"(?i:hello) world",
        valid: &["HeLLo world"],
        invalid: &["hello World"],
    },
    RxCase {
        rx: r"[^\n]{1,40}\n",
        valid: &["a line\n"],
        invalid: &["\n", "two\nlines\n"],
    },
    RxCase {
        rx: r"(.+)",
        valid: &["anything at all <|im_start|>"],
        invalid: &["", "a\nb"],
    },
    RxCase {
        rx: r"[α-ω]{2,5}",
        valid: &["αβγ"],
        invalid: &["α", "abc"],
    },
    RxCase {
        rx: r"https?://[a-z]+(\.[a-z]+)+(/[a-z0-9]*)*",
        valid: &["https://example.com/a/b1"],
        invalid: &["ftp://example.com", "http://localhost"],
    },
    RxCase {
        rx: r#"\{"k": (true|false)\}"#,
        valid: &[r#"{"k": true}"#],
        invalid: &[r#"{"k": 1}"#],
    },
];

fn check_rx_case(m: &Model, c: &RxCase) {
    let compiled = compile(m, &Constraint::regex(c.rx));
    for v in c.valid {
        let mut matcher = compiled.matcher();
        assert_eq!(
            feed_text(m, &mut matcher, v),
            None,
            "{}: {v:?} rejected",
            c.rx
        );
        assert!(
            eos_allowed(m, &mut matcher),
            "{}: {v:?} not accepting",
            c.rx
        );
    }
    for v in c.invalid {
        let mut matcher = compiled.matcher();
        let rejected = feed_text(m, &mut matcher, v).is_some() || !eos_allowed(m, &mut matcher);
        assert!(rejected, "{}: {v:?} accepted", c.rx);
    }
}

fn walk_and_check(
    m: &Model,
    c: &Constraint,
    independent: &Regex,
    walks: usize,
    seed: u64,
) -> usize {
    let compiled = compile(m, c);
    let mut rng = Rng::new(seed);
    let mut finished = 0;
    for _ in 0..walks {
        let mut matcher = compiled.matcher();
        let walk = random_walk(m, &mut matcher, &mut rng, 120);
        if walk.finished {
            let text = String::from_utf8(walk.bytes).expect("walk output is UTF-8");
            finished += 1;
            assert!(independent.is_match(&text), "{c:?}: walk produced {text:?}");
        }
    }
    finished
}

#[test]
fn regex_fixtures_are_accepted_and_rejected_on_both_vocabularies() {
    for m in [smollm(), qwen()] {
        for c in REGEXES {
            check_rx_case(m, c);
        }
    }
}

#[test]
fn regex_random_walks_match_the_regex_crate() {
    let m = smollm();
    let mut finished = 0;
    for (i, c) in REGEXES.iter().enumerate() {
        let independent = Regex::new(&format!(r"\A(?:{})\z", c.rx)).expect("regex crate");
        finished += walk_and_check(m, &Constraint::regex(c.rx), &independent, 8, i as u64);
    }
    assert!(finished >= 50, "only {finished} walks finished");
}

#[test]
fn choices_accept_exactly_their_literals_with_metacharacters_escaped() {
    let m = qwen();
    let choices = ["a.b", "(x|y)", "c*", "plain", "new\nline", "", "[]"];
    let compiled = compile(m, &Constraint::choice(choices));
    for c in choices {
        let mut matcher = compiled.matcher();
        assert_eq!(feed_text(m, &mut matcher, c), None, "{c:?} rejected");
        assert!(eos_allowed(m, &mut matcher), "{c:?} not accepting");
    }
    for bad in ["aXb", "x", "ccc", "plainer", "(x|y)z"] {
        let mut matcher = compiled.matcher();
        let rejected = feed_text(m, &mut matcher, bad).is_some() || !eos_allowed(m, &mut matcher);
        assert!(rejected, "{bad:?} accepted");
    }
}

#[test]
fn lark_arithmetic_grammar_accepts_expressions_and_walks_stay_balanced() {
    let m = smollm();
    let grammar = r#"start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"#;
    let compiled = compile(m, &Constraint::lark(grammar));
    for ok in ["1+2*3", "(1+2)*(3-4)/5", "((7))"] {
        let mut matcher = compiled.matcher();
        assert_eq!(feed_text(m, &mut matcher, ok), None, "{ok}");
        assert!(eos_allowed(m, &mut matcher), "{ok}");
    }
    for bad in ["1+", "(1+2", "1++2", "1234"] {
        let mut matcher = compiled.matcher();
        let rejected = feed_text(m, &mut matcher, bad).is_some() || !eos_allowed(m, &mut matcher);
        assert!(rejected, "{bad} accepted");
    }
    // Independent check: balanced parentheses and the flat token shape.
    let flat = Regex::new(r"\A[0-9]{1,3}(?:[+\-*/][0-9]{1,3})*\z").expect("regex");
    let inner = Regex::new(r"\(([0-9+\-*/]+)\)").expect("regex");
    let mut rng = Rng::new(7);
    let mut finished = 0;
    for _ in 0..12 {
        let mut matcher = compiled.matcher();
        let walk = random_walk(m, &mut matcher, &mut rng, 80);
        if !walk.finished {
            continue;
        }
        finished += 1;
        let mut text = String::from_utf8(walk.bytes).expect("utf-8");
        // Reduce innermost parenthesised groups until none remain.
        while inner.is_match(&text) {
            let reduced = inner.replace_all(&text, |c: &regex::Captures| {
                if flat.is_match(&c[1]) {
                    "1".to_string()
                } else {
                    "!".to_string()
                }
            });
            text = reduced.into_owned();
        }
        assert!(flat.is_match(&text), "walk reduced to {text:?}");
    }
    assert!(finished >= 3, "only {finished} walks finished");
}

#[test]
fn apply_patch_grammar_accepts_patches_and_walks_match_the_regex_crate() {
    let m = qwen();
    let independent = Regex::new(APPLY_PATCH_RX).expect("regex");
    let compiled = compile(m, &Constraint::lark(APPLY_PATCH));
    let patch = "*** Begin Patch\n*** Add File: src/new.rs\n+fn main() {}\n+\n*** Update File: src/lib.rs\n*** Move to: src/core.rs\n@@ fn old()\n-    old();\n+    new();\n     keep();\n*** End of File\n*** Delete File: README.md\n*** End Patch\n";
    assert!(independent.is_match(patch));
    let mut matcher = compiled.matcher();
    assert_eq!(feed_text(m, &mut matcher, patch), None);
    assert!(eos_allowed(m, &mut matcher));
    for bad in [
        "*** Begin Patch\n*** End Patch\n",
        "*** Begin Patch\n*** Add File: a\n*** End Patch\n",
        "*** Begin Patch\n*** Remove File: a\n*** End Patch\n",
    ] {
        assert!(!independent.is_match(bad));
        let mut matcher = compiled.matcher();
        let rejected = feed_text(m, &mut matcher, bad).is_some() || !eos_allowed(m, &mut matcher);
        assert!(rejected, "{bad:?} accepted");
    }
    let finished = walk_and_check(m, &Constraint::lark(APPLY_PATCH), &independent, 10, 11);
    assert!(finished >= 2, "only {finished} walks finished");
}

#[test]
fn file_path_grammar_walks_match_the_regex_crate() {
    let independent = Regex::new(FILE_PATH_RX).expect("regex");
    for m in [smollm(), qwen()] {
        let compiled = compile(m, &Constraint::lark(FILE_PATH));
        for ok in ["src/main.rs", "a/b-c/d_e.tar.gz"] {
            let mut matcher = compiled.matcher();
            assert_eq!(feed_text(m, &mut matcher, ok), None, "{ok}");
            assert!(eos_allowed(m, &mut matcher));
        }
        for bad in ["/abs", "a//b", "a b", "a/"] {
            let mut matcher = compiled.matcher();
            let rejected =
                feed_text(m, &mut matcher, bad).is_some() || !eos_allowed(m, &mut matcher);
            assert!(rejected, "{bad:?} accepted");
        }
        let finished = walk_and_check(m, &Constraint::lark(FILE_PATH), &independent, 12, 3);
        assert!(finished >= 6, "only {finished} walks finished");
    }
}
