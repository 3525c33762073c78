//! Structured output end to end on real models (SmolLM2-135M and Qwen2.5-Coder-0.5B),
//! greedy and seeded sampling at temperature 0.8: every constrained output is checked by an
//! independent engine — the `jsonschema` crate (formats on) for JSON Schemas, the `regex`
//! crate for regexes, small hand-written parsers for the Lark grammars — and the normal
//! case ends with "stop", not the token limit. Requests go through the engine in batches
//! (several sequences per step). The `lockstep` binary's structured-output flags are tested
//! in the CLI's tests (`crates/cli/tests/cli/constrained.rs`).

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use grammar::{CompiledConstraint, Constraint, GrammarLimits, TokenEnv};
use lockstep_engine::{
    Completion, Engine, EngineConfig, GenerateRequest, ModelBackend, SamplingParams,
};
use serde_json::{Value, json};
use text::{EncodeOptions, Tokenizer};

const SMOLLM: &str = "smollm2-135m";
const QWEN: &str = "qwen2.5-coder-0.5b";

/// A loaded model with its tokenizer and token environment.
struct Fixture {
    name: &'static str,
    model: Arc<model::Model>,
    tok: Arc<Tokenizer>,
    env: Arc<TokenEnv>,
}

fn load(name: &'static str) -> Fixture {
    let path = hub::ensure_model(name).expect("model in the cache");
    let file = Arc::new(gguf::GgufFile::open(&path).expect("GGUF opens"));
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let opts = model::LoadOptions {
        threads: Some(2),
        n_ctx: Some(2048),
        ..model::LoadOptions::default()
    };
    let model = Arc::new(model::Model::load(file, &opts).expect("model loads"));
    let env = TokenEnv::with_logit_width(tok.clone(), model.config().n_vocab).expect("token env");
    Fixture {
        name,
        model,
        tok,
        env,
    }
}

fn fixture(name: &'static str) -> &'static Fixture {
    static SMOL: OnceLock<Fixture> = OnceLock::new();
    static QW: OnceLock<Fixture> = OnceLock::new();
    match name {
        SMOLLM => SMOL.get_or_init(|| load(SMOLLM)),
        _ => QW.get_or_init(|| load(QWEN)),
    }
}

/// The real-model tests take turns: each batch already uses both cores.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A ChatML prompt (both models use ChatML).
fn chat(f: &Fixture, system: &str, user: &str) -> Vec<u32> {
    let text = format!(
        "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    f.tok.encode(&text, EncodeOptions::raw_prompt())
}

fn compile(f: &Fixture, c: &Constraint) -> CompiledConstraint {
    c.compile(&f.env, &GrammarLimits::default())
        .unwrap_or_else(|e| panic!("{}: {c:?} does not compile: {e}", f.name))
}

/// Greedy, then seeded sampling at T = 0.8.
fn samplings(seed: u64) -> [(String, SamplingParams); 2] {
    [
        ("greedy".to_string(), SamplingParams::greedy()),
        (
            format!("T=0.8 seed {seed}"),
            SamplingParams {
                temperature: 0.8,
                seed,
                ..SamplingParams::default()
            },
        ),
    ]
}

fn request(
    prompt: Vec<u32>,
    sampling: SamplingParams,
    c: &CompiledConstraint,
    max_tokens: usize,
) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt, sampling);
    r.max_tokens = Some(max_tokens);
    r.constraint = Some(Box::new(c.matcher()));
    r
}

/// Runs the requests through one engine, eight sequences per step, in order.
fn run_batch(f: &Fixture, requests: Vec<GenerateRequest>) -> Vec<Completion> {
    let engine = Engine::start(
        Box::new(ModelBackend::new(f.model.clone())),
        f.tok.clone(),
        EngineConfig {
            max_seqs: 8,
            kv_tokens: 8 * 2048,
            ..EngineConfig::default()
        },
    )
    .expect("engine starts");
    let mut out = Vec::with_capacity(requests.len());
    let mut requests = requests.into_iter().peekable();
    while requests.peek().is_some() {
        let handles: Vec<_> = requests
            .by_ref()
            .take(48)
            .map(|r| engine.submit(r).expect("request accepted"))
            .collect();
        out.extend(handles.into_iter().map(|h| h.collect()));
    }
    engine.shutdown();
    out
}

fn finish(c: &Completion) -> &'static str {
    c.finish.map_or("error", |f| f.as_openai_str())
}

/// The generated tokens other than a final end-of-generation token.
fn payload_tokens<'a>(f: &Fixture, c: &'a Completion) -> &'a [u32] {
    match c.tokens.split_last() {
        Some((last, rest)) if f.tok.is_eos(*last) => rest,
        _ => &c.tokens,
    }
}

/// No special token (BOS, EOS, chat marker) inside the payload, and no marker text.
fn assert_no_special_tokens(f: &Fixture, c: &Completion, what: &str) {
    for &t in payload_tokens(f, c) {
        assert!(
            !f.tok.is_special(t) && !f.env.is_special(t),
            "{what}: special token {t} ({:?}) in the output {:?}",
            f.tok.token_text(t),
            c.text
        );
    }
    for marker in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|fim_"] {
        assert!(!c.text.contains(marker), "{what}: {marker} in {:?}", c.text);
    }
}

// ---------------------------------------------------------------------------------------
// JSON Schema
// ---------------------------------------------------------------------------------------

/// A schema and a task that makes sense for it.
struct SchemaCase {
    name: &'static str,
    task: &'static str,
    schema: Value,
}

fn sc(name: &'static str, task: &'static str, schema: Value) -> SchemaCase {
    SchemaCase { name, task, schema }
}

fn schema_cases() -> Vec<SchemaCase> {
    vec![
        sc(
            "person",
            "Describe Ada Lovelace.",
            json!({"type": "object", "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "format": "email"},
                "languages": {"type": "array", "items": {"type": "string", "maxLength": 20},
                              "minItems": 1, "maxItems": 3}},
              "required": ["name", "age", "email", "languages"], "additionalProperties": false}),
        ),
        sc(
            "nested address",
            "Give the postal address of a museum in Paris.",
            json!({"type": "object", "properties": {
                "museum": {"type": "string", "maxLength": 60},
                "address": {"type": "object", "properties": {
                    "street": {"type": "string", "maxLength": 60},
                    "city": {"type": "string", "maxLength": 30},
                    "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "country": {"enum": ["France", "Germany", "Italy"]}},
                  "required": ["street", "city", "postcode", "country"],
                  "additionalProperties": false}},
              "required": ["museum", "address"], "additionalProperties": false}),
        ),
        sc(
            "order with line items",
            "Write an order for two books and one pen.",
            json!({"type": "object", "properties": {
                "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                    "type": "object", "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                        "price": {"type": "number", "minimum": 0, "maximum": 1000}},
                    "required": ["sku", "quantity", "price"], "additionalProperties": false}},
                "paid": {"type": "boolean"}},
              "required": ["order_id", "items", "paid"], "additionalProperties": false}),
        ),
        sc(
            "enum",
            "What color is the sky on a clear day?",
            json!({"type": "object", "properties": {
                "color": {"enum": ["red", "green", "blue", "yellow"]}},
              "required": ["color"], "additionalProperties": false}),
        ),
        sc(
            "const",
            "Report the API version 1.0 and whether the service is healthy.",
            json!({"type": "object", "properties": {
                "version": {"const": "1.0"}, "healthy": {"type": "boolean"}},
              "required": ["version", "healthy"], "additionalProperties": false}),
        ),
        sc(
            "integer bounds",
            "Rate the movie Casablanca from 1 to 10.",
            json!({"type": "object", "properties": {
                "movie": {"type": "string", "maxLength": 40},
                "score": {"type": "integer", "minimum": 1, "maximum": 10}},
              "required": ["movie", "score"], "additionalProperties": false}),
        ),
        sc(
            "number bounds",
            "Give today's temperature in Oslo in degrees Celsius and the humidity.",
            json!({"type": "object", "properties": {
                "celsius": {"type": "number", "minimum": -50, "maximum": 50},
                "humidity": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["celsius", "humidity"], "additionalProperties": false}),
        ),
        sc(
            "exclusive bounds",
            "Give a probability strictly between 0 and 1 that it rains tomorrow, and a count of clouds.",
            json!({"type": "object", "properties": {
                "probability": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                "clouds": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
              "required": ["probability", "clouds"], "additionalProperties": false}),
        ),
        sc(
            "multipleOf",
            "Pick a round number of minutes (a multiple of 5) for a meeting.",
            json!({"type": "object", "properties": {
                "minutes": {"type": "integer", "multipleOf": 5, "minimum": 5, "maximum": 120}},
              "required": ["minutes"], "additionalProperties": false}),
        ),
        sc(
            "string length",
            "Suggest a username for Grace Hopper.",
            json!({"type": "object", "properties": {
                "username": {"type": "string", "minLength": 3, "maxLength": 12}},
              "required": ["username"], "additionalProperties": false}),
        ),
        sc(
            "string pattern",
            "Give a US phone number for a pizza shop.",
            json!({"type": "object", "properties": {
                "shop": {"type": "string", "maxLength": 30},
                "phone": {"type": "string", "pattern": "^\\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}$"}},
              "required": ["shop", "phone"], "additionalProperties": false}),
        ),
        sc(
            "format date",
            "When was the Eiffel Tower opened?",
            json!({"type": "object", "properties": {
                "event": {"type": "string", "maxLength": 40},
                "date": {"type": "string", "format": "date"}},
              "required": ["event", "date"], "additionalProperties": false}),
        ),
        sc(
            "format date-time",
            "Schedule a meeting next Monday morning.",
            json!({"type": "object", "properties": {
                "title": {"type": "string", "maxLength": 40},
                "start": {"type": "string", "format": "date-time"}},
              "required": ["title", "start"], "additionalProperties": false}),
        ),
        sc(
            "format time",
            "At what time does a typical office open?",
            json!({"type": "object", "properties": {"opens": {"type": "string", "format": "time"}},
              "required": ["opens"], "additionalProperties": false}),
        ),
        sc(
            "format email",
            "Give the contact e-mail of a support team at example.com.",
            json!({"type": "object", "properties": {
                "team": {"type": "string", "maxLength": 30},
                "email": {"type": "string", "format": "email"}},
              "required": ["team", "email"], "additionalProperties": false}),
        ),
        sc(
            "format uuid",
            "Create a record with a random identifier for a new user called bob.",
            json!({"type": "object", "properties": {
                "id": {"type": "string", "format": "uuid"},
                "user": {"type": "string", "maxLength": 20}},
              "required": ["id", "user"], "additionalProperties": false}),
        ),
        sc(
            "format ipv4 and hostname",
            "Describe a web server: its host name and IPv4 address.",
            json!({"type": "object", "properties": {
                "host": {"type": "string", "format": "hostname"},
                "ip": {"type": "string", "format": "ipv4"}},
              "required": ["host", "ip"], "additionalProperties": false}),
        ),
        sc(
            "$defs and $ref",
            "Give the corners of a small triangle.",
            json!({"$defs": {"point": {"type": "object", "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                  "required": ["x", "y"], "additionalProperties": false}},
              "type": "object", "properties": {
                "corners": {"type": "array", "items": {"$ref": "#/$defs/point"},
                            "minItems": 3, "maxItems": 3}},
              "required": ["corners"], "additionalProperties": false}),
        ),
        sc(
            "definitions and $ref",
            "Give the sender and the receiver of a letter.",
            json!({"definitions": {"party": {"type": "object", "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "city": {"type": "string", "maxLength": 30}},
                  "required": ["name", "city"], "additionalProperties": false}},
              "type": "object", "properties": {
                "from": {"$ref": "#/definitions/party"}, "to": {"$ref": "#/definitions/party"}},
              "required": ["from", "to"], "additionalProperties": false}),
        ),
        sc(
            "anyOf",
            "How many legs does a spider have? Answer with a number or a word.",
            json!({"type": "object", "properties": {
                "answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                     {"type": "string", "maxLength": 10}]}},
              "required": ["answer"], "additionalProperties": false}),
        ),
        sc(
            "oneOf with discriminator",
            "Describe one geometric shape: a circle or a rectangle.",
            json!({"type": "object", "properties": {"shape": {"oneOf": [
                {"type": "object", "properties": {"kind": {"const": "circle"},
                    "radius": {"type": "number", "minimum": 0, "maximum": 100}},
                 "required": ["kind", "radius"], "additionalProperties": false},
                {"type": "object", "properties": {"kind": {"const": "rectangle"},
                    "width": {"type": "number", "minimum": 0, "maximum": 100},
                    "height": {"type": "number", "minimum": 0, "maximum": 100}},
                 "required": ["kind", "width", "height"], "additionalProperties": false}]}},
              "required": ["shape"], "additionalProperties": false}),
        ),
        sc(
            "allOf",
            "Describe an employee with a name and an employee number.",
            json!({"allOf": [
                {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}},
                 "required": ["name"]},
                {"type": "object", "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 9999}},
                 "required": ["number"]}]}),
        ),
        sc(
            "optional properties",
            "Describe a book; the subtitle is optional.",
            json!({"type": "object", "properties": {
                "title": {"type": "string", "maxLength": 50},
                "subtitle": {"type": "string", "maxLength": 50},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
              "required": ["title", "year"], "additionalProperties": false}),
        ),
        sc(
            "nullable via type list",
            "Describe a person whose middle name is unknown.",
            json!({"type": "object", "properties": {
                "first": {"type": "string", "maxLength": 20},
                "middle": {"type": ["string", "null"], "maxLength": 20},
                "last": {"type": "string", "maxLength": 20}},
              "required": ["first", "middle", "last"], "additionalProperties": false}),
        ),
        sc(
            "top-level array",
            "List three fruits.",
            json!({"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 15},
                   "minItems": 2, "maxItems": 4}),
        ),
        sc(
            "top-level integer",
            "How many days are in a week?",
            json!({"type": "integer", "minimum": 0, "maximum": 1000}),
        ),
        sc(
            "tuple via prefixItems",
            "Give the latitude and longitude of Rome.",
            json!({"type": "object", "properties": {"coordinates": {"type": "array",
                "prefixItems": [{"type": "number", "minimum": -90, "maximum": 90},
                                {"type": "number", "minimum": -180, "maximum": 180}],
                "items": false, "minItems": 2}},
              "required": ["coordinates"], "additionalProperties": false}),
        ),
        sc(
            "map via additionalProperties",
            "Count the vowels in the word banana, one key per vowel.",
            json!({"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 20},
                   "maxProperties": 5}),
        ),
        sc(
            "patternProperties",
            "Give the stock of three products keyed by product code.",
            json!({"type": "object", "patternProperties": {
                "^P[0-9]{2}$": {"type": "integer", "minimum": 0, "maximum": 1000}},
              "additionalProperties": false, "maxProperties": 4}),
        ),
        sc(
            "nested configuration",
            "Write the configuration of a web service with a database.",
            json!({"type": "object", "properties": {
                "server": {"type": "object", "properties": {
                    "host": {"type": "string", "format": "hostname"},
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
                  "required": ["host", "port"], "additionalProperties": false},
                "database": {"type": "object", "properties": {
                    "engine": {"enum": ["postgres", "mysql", "sqlite"]},
                    "pool": {"type": "integer", "minimum": 1, "maximum": 64}},
                  "required": ["engine", "pool"], "additionalProperties": false},
                "features": {"type": "array", "items": {"enum": ["auth", "cache", "metrics"]},
                             "maxItems": 3}},
              "required": ["server", "database", "features"], "additionalProperties": false}),
        ),
        sc(
            "recursive tree",
            "Draw a tiny family tree: one grandparent with two children.",
            json!({"$defs": {"node": {"type": "object", "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                  "required": ["name", "children"], "additionalProperties": false}},
              "$ref": "#/$defs/node"}),
        ),
        sc(
            "recursive root reference",
            "Write a short comment thread: one comment with one reply.",
            json!({"type": "object", "properties": {
                "text": {"type": "string", "maxLength": 60},
                "replies": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
              "required": ["text", "replies"], "additionalProperties": false}),
        ),
        sc(
            "enum of mixed types",
            "Is water wet? Answer yes, no, or 1 or 0.",
            json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no", 1, 0, null]}},
                   "required": ["answer"], "additionalProperties": false}),
        ),
        sc(
            "minProperties with free object",
            "Describe a cat with a few properties of your choice.",
            json!({"type": "object", "minProperties": 1, "maxProperties": 4,
                   "additionalProperties": {"type": ["string", "integer", "boolean"], "maxLength": 30}}),
        ),
    ]
}

fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .expect("the jsonschema crate accepts the schema")
}

/// Every schema on one model, greedy and sampled: outputs that stop validate, and every
/// output stops.
fn json_schema_suite(model: &'static str) {
    let f = fixture(model);
    let _g = serial();
    let cases = schema_cases();
    assert!(cases.len() >= 30, "only {} schemas", cases.len());
    let system = "You are a helpful assistant. You answer with one JSON value only.";
    let mut requests = Vec::new();
    let mut labels = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let compiled = compile(f, &Constraint::json_schema(case.schema.clone()));
        let user = format!(
            "{} Reply in JSON matching this JSON Schema:\n{}",
            case.task, case.schema
        );
        let prompt = chat(f, system, &user);
        for (label, sampling) in samplings(1000 + i as u64) {
            requests.push(request(prompt.clone(), sampling, &compiled, 256));
            labels.push((i, label));
        }
    }
    let outputs = run_batch(f, requests);
    let mut failures = Vec::new();
    let mut unfinished = Vec::new();
    for ((i, label), out) in labels.iter().zip(&outputs) {
        let case = &cases[*i];
        let what = format!("{model} / {} / {label}", case.name);
        assert_eq!(out.error, None, "{what}");
        assert_no_special_tokens(f, out, &what);
        if finish(out) != "stop" {
            unfinished.push(format!("{what}: {:?}", out.text));
            continue;
        }
        let value: Value = match serde_json::from_str(&out.text) {
            Ok(v) => v,
            Err(e) => {
                failures.push(format!("{what}: not JSON ({e}): {:?}", out.text));
                continue;
            }
        };
        let errors: Vec<String> = validator(&case.schema)
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        if !errors.is_empty() {
            failures.push(format!("{what}: {value} is invalid: {errors:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} outputs failed:\n{}",
        failures.len(),
        outputs.len(),
        failures.join("\n")
    );
    assert_mostly_stopped(&unfinished, outputs.len());
}

/// The normal case ends with "stop": at most one output in ten runs into the token limit
/// (a tiny model can loop inside an unbounded part of the language, such as recursion).
fn assert_mostly_stopped(unfinished: &[String], total: usize) {
    assert!(
        unfinished.len() * 10 <= total,
        "{} of {total} outputs hit the token limit:\n{}",
        unfinished.len(),
        unfinished.join("\n")
    );
}

#[test]
fn smollm2_json_schema_outputs_stop_and_validate_greedy_and_sampled() {
    json_schema_suite(SMOLLM);
}

#[test]
fn qwen_json_schema_outputs_stop_and_validate_greedy_and_sampled() {
    json_schema_suite(QWEN);
}

// ---------------------------------------------------------------------------------------
// Regex
// ---------------------------------------------------------------------------------------

fn regex_cases() -> Vec<(&'static str, &'static str)> {
    vec![
        (
            "What is the date of the first Moon landing?",
            r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
        ),
        ("Give a CSS color for a dark blue.", r"#[0-9a-f]{6}"),
        (
            "What is the latest version of your favourite library?",
            r"v?[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}",
        ),
        ("Is the Earth round? Answer yes or no.", r"(yes|no)"),
        (
            "List three prime numbers.",
            r"\[[0-9]{1,4}(, [0-9]{1,4}){2}\]",
        ),
        (
            "What time is it in a movie scene at noon?",
            r"([01][0-9]|2[0-3]):[0-5][0-9]",
        ),
        (
            "Name a famous scientist in one short sentence.",
            r"[A-Z][a-z]+( [a-zA-Z,']+){2,12}\.",
        ),
        (
            "Give an IPv4 address of a local network.",
            r"192\.168\.[0-9]{1,3}\.[0-9]{1,3}",
        ),
        (
            "Write a Python function name for computing an average.",
            r"[a-z_][a-z0-9_]{2,30}",
        ),
        ("Give a US zip code and its city.", r"[0-9]{5} [A-Z][a-z]+"),
    ]
}

fn regex_suite(model: &'static str) {
    let f = fixture(model);
    let _g = serial();
    let system = "You are a helpful assistant. Answer briefly.";
    let mut requests = Vec::new();
    let mut labels = Vec::new();
    let cases = regex_cases();
    for (i, (task, rx)) in cases.iter().enumerate() {
        let compiled = compile(f, &Constraint::regex(*rx));
        let prompt = chat(f, system, task);
        for (label, sampling) in samplings(2000 + i as u64) {
            requests.push(request(prompt.clone(), sampling, &compiled, 96));
            labels.push((i, label));
        }
    }
    let outputs = run_batch(f, requests);
    let mut unfinished = Vec::new();
    for ((i, label), out) in labels.iter().zip(&outputs) {
        let rx = cases[*i].1;
        let what = format!("{model} / regex {rx} / {label}");
        assert_eq!(out.error, None, "{what}");
        assert_no_special_tokens(f, out, &what);
        if finish(out) != "stop" {
            unfinished.push(format!("{what}: {:?}", out.text));
            continue;
        }
        let full = regex::Regex::new(&format!("^(?:{rx})$")).expect("regex");
        assert!(full.is_match(&out.text), "{what}: {:?}", out.text);
    }
    assert_mostly_stopped(&unfinished, outputs.len());
}

#[test]
fn smollm2_regex_outputs_match_by_the_regex_crate() {
    regex_suite(SMOLLM);
}

#[test]
fn qwen_regex_outputs_match_by_the_regex_crate() {
    regex_suite(QWEN);
}

// ---------------------------------------------------------------------------------------
// Lark
// ---------------------------------------------------------------------------------------

/// An `apply_patch`-style diff (the format of OpenAI's patch tool), bounded so that an
/// output always ends.
const PATCH_GRAMMAR: &str = r#"
start: begin_patch hunk{1,3} end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch"
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " FILENAME LF add_line{1,12}
delete_hunk: "*** Delete File: " FILENAME LF
update_hunk: "*** Update File: " FILENAME LF change_move? change
change_move: "*** Move to: " FILENAME LF
change: (change_context | change_line){1,16}
change_context: "@@" LF | "@@ " TEXT LF
change_line: ("+" | "-" | " ") LINE LF
add_line: "+" LINE LF
FILENAME: /[A-Za-z0-9_.\/-]{1,60}/
TEXT: /[^\n]{1,80}/
LINE: /[^\n]{0,100}/
LF: "\n"
"#;

/// A path grammar: an optional root, then segments separated by `/`.
const PATH_GRAMMAR: &str = r#"
start: ROOT? segment ("/" segment){0,6}
ROOT: "/" | "./"
segment: SEGMENT
SEGMENT: /[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}/
"#;

/// Arithmetic over integers with nesting.
const ARITH_GRAMMAR: &str = r#"
start: expr
expr: term (ADDOP term){0,6}
term: factor (MULOP factor){0,4}
factor: NUMBER | "(" expr ")"
ADDOP: " + " | " - "
MULOP: " * "
NUMBER: /[0-9]{1,4}/
"#;

/// `key = value` lines.
const CONFIG_GRAMMAR: &str = r#"
start: line{1,6}
line: KEY " = " value "\n"
value: NUMBER | BOOL | STRING
KEY: /[a-z][a-z_]{0,20}/
NUMBER: /[0-9]{1,6}/
BOOL: "true" | "false"
STRING: /"[a-zA-Z0-9 .,:\/_-]{0,40}"/
"#;

/// Checks an `apply_patch` document line by line (an independent reading of the format).
fn check_patch(text: &str) -> Result<(), String> {
    let lines: Vec<&str> = text.split('\n').collect();
    let (first, rest) = lines.split_first().ok_or("empty")?;
    if *first != "*** Begin Patch" {
        return Err(format!("first line {first:?}"));
    }
    let (last, body) = rest.split_last().ok_or("no end")?;
    if *last != "*** End Patch" {
        return Err(format!("last line {last:?}"));
    }
    let filename = |s: &str| {
        !s.is_empty()
            && s.len() <= 60
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c))
    };
    let mut hunks = 0;
    let mut i = 0;
    while i < body.len() {
        let line = body[i];
        i += 1;
        hunks += 1;
        if let Some(name) = line.strip_prefix("*** Add File: ") {
            if !filename(name) {
                return Err(format!("bad file name {name:?}"));
            }
            let start = i;
            while i < body.len() && body[i].starts_with('+') {
                i += 1;
            }
            if i == start {
                return Err(format!("added file {name} has no lines"));
            }
        } else if let Some(name) = line.strip_prefix("*** Delete File: ") {
            if !filename(name) {
                return Err(format!("bad file name {name:?}"));
            }
        } else if let Some(name) = line.strip_prefix("*** Update File: ") {
            if !filename(name) {
                return Err(format!("bad file name {name:?}"));
            }
            if let Some(to) = body.get(i).and_then(|l| l.strip_prefix("*** Move to: ")) {
                if !filename(to) {
                    return Err(format!("bad move target {to:?}"));
                }
                i += 1;
            }
            let start = i;
            while i < body.len()
                && (body[i] == "@@"
                    || body[i].starts_with("@@ ")
                    || body[i].starts_with(['+', '-', ' ']))
            {
                i += 1;
            }
            if i == start {
                return Err(format!("update of {name} has no changes"));
            }
        } else {
            return Err(format!("unexpected line {line:?}"));
        }
    }
    if !(1..=3).contains(&hunks) {
        return Err(format!("{hunks} hunks"));
    }
    Ok(())
}

fn check_path(text: &str) -> Result<(), String> {
    let rest = text
        .strip_prefix("./")
        .or_else(|| text.strip_prefix('/'))
        .unwrap_or(text);
    let segments: Vec<&str> = rest.split('/').collect();
    if segments.len() > 7 {
        return Err(format!("{} segments", segments.len()));
    }
    for s in segments {
        let mut chars = s.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
        if !first_ok || !rest_ok || s.len() > 32 {
            return Err(format!("bad segment {s:?}"));
        }
    }
    Ok(())
}

/// A recursive-descent parser and evaluator for [`ARITH_GRAMMAR`] (checked arithmetic).
fn eval_arith(text: &str) -> Result<i64, String> {
    struct P<'a> {
        s: &'a [u8],
        i: usize,
    }
    impl P<'_> {
        fn eat(&mut self, lit: &str) -> bool {
            if self.s[self.i..].starts_with(lit.as_bytes()) {
                self.i += lit.len();
                true
            } else {
                false
            }
        }
        fn expr(&mut self) -> Result<i64, String> {
            let mut v = self.term()?;
            loop {
                if self.eat(" + ") {
                    v = v.checked_add(self.term()?).ok_or("overflow")?;
                } else if self.eat(" - ") {
                    v = v.checked_sub(self.term()?).ok_or("overflow")?;
                } else {
                    return Ok(v);
                }
            }
        }
        fn term(&mut self) -> Result<i64, String> {
            let mut v = self.factor()?;
            while self.eat(" * ") {
                v = v.checked_mul(self.factor()?).ok_or("overflow")?;
            }
            Ok(v)
        }
        fn factor(&mut self) -> Result<i64, String> {
            if self.eat("(") {
                let v = self.expr()?;
                return if self.eat(")") {
                    Ok(v)
                } else {
                    Err(format!("no ) at {}", self.i))
                };
            }
            let start = self.i;
            while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
            let digits = &self.s[start..self.i];
            if digits.is_empty() || digits.len() > 4 {
                return Err(format!("bad number at {start}"));
            }
            std::str::from_utf8(digits)
                .map_err(|e| e.to_string())?
                .parse()
                .map_err(|e: std::num::ParseIntError| e.to_string())
        }
    }
    let mut p = P {
        s: text.as_bytes(),
        i: 0,
    };
    let v = p.expr()?;
    if p.i != text.len() {
        return Err(format!("trailing text at {}", p.i));
    }
    Ok(v)
}

fn check_config(text: &str) -> Result<(), String> {
    let body = text.strip_suffix('\n').ok_or("no final newline")?;
    let lines: Vec<&str> = body.split('\n').collect();
    if !(1..=6).contains(&lines.len()) {
        return Err(format!("{} lines", lines.len()));
    }
    for line in lines {
        let (key, value) = line
            .split_once(" = ")
            .ok_or(format!("no ' = ' in {line:?}"))?;
        let key_ok = key.len() <= 21
            && key.starts_with(|c: char| c.is_ascii_lowercase())
            && key.chars().all(|c| c.is_ascii_lowercase() || c == '_');
        let value_ok = value == "true"
            || value == "false"
            || (!value.is_empty() && value.len() <= 6 && value.bytes().all(|b| b.is_ascii_digit()))
            || (value.len() >= 2
                && value.len() <= 42
                && value.starts_with('"')
                && value.ends_with('"')
                && value[1..value.len() - 1]
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || " .,:/_-".contains(c)));
        if !key_ok || !value_ok {
            return Err(format!("bad line {line:?}"));
        }
    }
    Ok(())
}

type Checker = fn(&str) -> Result<(), String>;

fn lark_cases() -> Vec<(&'static str, &'static str, &'static str, Checker)> {
    vec![
        (
            "apply_patch",
            "Here is src/math.py:\n```\ndef add(a, b):\n    return a+b\n```\nWrite a patch in the \
             apply_patch format (*** Begin Patch, *** Update File: src/math.py, @@, -/+ lines, \
             *** End Patch) that renames add to plus.",
            PATCH_GRAMMAR,
            check_patch,
        ),
        (
            "apply_patch new file",
            "Write a patch in the apply_patch format (*** Begin Patch, *** Add File: NAME, lines \
             starting with +, *** End Patch) that adds a file hello.txt saying hello.",
            PATCH_GRAMMAR,
            check_patch,
        ),
        (
            "path",
            "Where does a Rust project keep its main source file? Give the path only.",
            PATH_GRAMMAR,
            check_path,
        ),
        (
            "path absolute",
            "Give the absolute path of the hosts file on Linux.",
            PATH_GRAMMAR,
            check_path,
        ),
        (
            "arithmetic",
            "Write an arithmetic expression with parentheses that equals 42.",
            ARITH_GRAMMAR,
            |t| eval_arith(t).map(|_| ()),
        ),
        (
            "config",
            "Write a small configuration for a web server: port, debug flag and name.",
            CONFIG_GRAMMAR,
            check_config,
        ),
    ]
}

fn lark_suite(model: &'static str) {
    let f = fixture(model);
    let _g = serial();
    let system = "You are a helpful coding assistant.";
    let cases = lark_cases();
    let mut requests = Vec::new();
    let mut labels = Vec::new();
    for (i, (_, task, grammar, _)) in cases.iter().enumerate() {
        let compiled = compile(f, &Constraint::lark(*grammar));
        let prompt = chat(f, system, task);
        for (label, sampling) in samplings(3000 + i as u64) {
            requests.push(request(prompt.clone(), sampling, &compiled, 400));
            labels.push((i, label));
        }
    }
    let outputs = run_batch(f, requests);
    for ((i, label), out) in labels.iter().zip(&outputs) {
        let (name, _, _, check) = &cases[*i];
        let what = format!("{model} / lark {name} / {label}");
        assert_eq!(out.error, None, "{what}");
        assert_eq!(finish(out), "stop", "{what}: {:?}", out.text);
        if let Err(e) = check(&out.text) {
            panic!("{what}: {e} in {:?}", out.text);
        }
        assert_no_special_tokens(f, out, &what);
    }
}

#[test]
fn smollm2_lark_outputs_parse_with_independent_checkers() {
    lark_suite(SMOLLM);
}

#[test]
fn qwen_lark_outputs_parse_with_independent_checkers() {
    lark_suite(QWEN);
}

#[test]
fn independent_checkers_reject_what_the_grammars_reject() {
    assert!(check_patch("*** Begin Patch\n*** Delete File: a.txt\n*** End Patch").is_ok());
    assert!(check_patch("*** Begin Patch\n*** Add File: a.txt\n*** End Patch").is_err());
    assert!(check_patch("*** Begin Patch\n*** Delete File: a b\n*** End Patch").is_err());
    assert!(check_patch("*** Begin Patch\n*** Delete File: a\n").is_err());
    assert!(check_path("./src/main.rs").is_ok());
    assert!(check_path("src//main.rs").is_err() && check_path("-x").is_err());
    assert_eq!(eval_arith("(6 + 1) * 6"), Ok(42));
    assert!(eval_arith("6 +1").is_err() && eval_arith("(6").is_err());
    assert!(check_config("port = 80\nname = \"web\"\n").is_ok());
    assert!(check_config("port = 80").is_err() && check_config("Port = 1\n").is_err());
}

// ---------------------------------------------------------------------------------------
// Special tokens, long literals
// ---------------------------------------------------------------------------------------

/// A permissive regex and a filename rule never put BOS, EOS or a chat marker inside the
/// output, even when the prompt invites the model to write one; EOS only ends it.
#[test]
fn permissive_regex_and_filename_rule_never_emit_special_tokens() {
    let _g = serial();
    for model in [SMOLLM, QWEN] {
        let f = fixture(model);
        let constraints = [
            ("(.+)", Constraint::regex("(.+)"), 48),
            ("(?s:.+)", Constraint::regex("(?s:.+)"), 48),
            (
                "filename",
                Constraint::lark("start: FILENAME\nFILENAME: /[^\\/\\n]{1,64}/\n"),
                48,
            ),
        ];
        let prompts = [
            chat(f, "You are a helpful assistant.", "Say hi."),
            chat(
                f,
                "You are a helpful assistant.",
                "Repeat exactly: <|im_end|>\n<|im_start|>assistant\nDone<|endoftext|>",
            ),
            chat(
                f,
                "You are a helpful assistant.",
                "Name a file for a photo.",
            ),
        ];
        let mut requests = Vec::new();
        let mut labels = Vec::new();
        for (name, c, max) in &constraints {
            let compiled = compile(f, c);
            for (p, prompt) in prompts.iter().enumerate() {
                for (label, sampling) in samplings(4000 + p as u64) {
                    requests.push(request(prompt.clone(), sampling, &compiled, *max));
                    labels.push(format!("{model} / {name} / prompt {p} / {label}"));
                }
            }
        }
        let outputs = run_batch(f, requests);
        let mut stopped = 0;
        for (what, out) in labels.iter().zip(&outputs) {
            assert_eq!(out.error, None, "{what}");
            assert!(!out.tokens.is_empty(), "{what}");
            assert_no_special_tokens(f, out, what);
            // A natural end is EOS where the grammar accepts, or the grammar's own end
            // (the filename rule's 64 characters).
            if finish(out) == "stop" && out.tokens.last().is_some_and(|&t| f.tok.is_eos(t)) {
                stopped += 1;
            }
        }
        assert!(stopped > 0, "{model}: no output ended with EOS");
    }
}

/// A grammar that forces a long literal (~2.3 kB) is followed byte for byte, whatever the
/// model would rather say.
#[test]
fn a_forced_long_literal_is_followed_exactly() {
    let _g = serial();
    let literal: String = (1..=40)
        .map(|i| format!("Line {i:02}: the quick brown fox jumps over the lazy dog.\n"))
        .collect::<String>();
    let escaped = serde_json::to_string(&literal).expect("json string");
    for model in [SMOLLM, QWEN] {
        let f = fixture(model);
        let compiled = compile(f, &Constraint::lark(format!("start: {escaped}\n")));
        let prompt = chat(
            f,
            "You are a helpful assistant.",
            "Write a poem about the sea.",
        );
        let requests = samplings(5000)
            .into_iter()
            .map(|(_, s)| request(prompt.clone(), s, &compiled, 1024))
            .collect();
        for out in &run_batch(f, requests) {
            assert_eq!(out.error, None, "{model}");
            assert_eq!(finish(out), "stop", "{model}");
            assert_eq!(out.text, literal, "{model}");
        }
    }
}
