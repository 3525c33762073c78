//! Every golden conversation of `tests/data/golden/` renders byte for byte as HF
//! transformers rendered it, from the template stored in the real model's GGUF.

use crate::common::{golden_dir, model_template};
use lockstep_chat::{ChatTemplate, Message, detect_format};
use serde::Deserialize;

#[derive(Deserialize)]
struct GoldenFile {
    model: String,
    cases: Vec<GoldenCase>,
}

#[derive(Deserialize)]
struct GoldenCase {
    name: String,
    messages: Vec<Message>,
    #[serde(default)]
    tools: Option<Vec<serde_json::Value>>,
    add_generation_prompt: bool,
    rendered: String,
}

fn check_model(model: &str) -> usize {
    let path = golden_dir().join(format!("{model}.json"));
    let golden: GoldenFile =
        serde_json::from_slice(&std::fs::read(&path).expect("golden file")).expect("golden JSON");
    assert_eq!(golden.model, model);
    let (source, bos, eos) = model_template(model);
    let template = ChatTemplate::new(&source, &bos, &eos).expect("template compiles");
    let mut matched = 0;
    for case in &golden.cases {
        let got = template
            .render(
                &case.messages,
                case.tools.as_deref(),
                case.add_generation_prompt,
                Default::default(),
            )
            .unwrap_or_else(|e| panic!("{model}/{}: {e}", case.name));
        assert_eq!(got, case.rendered, "{model}/{}", case.name);
        matched += 1;
    }
    eprintln!(
        "{model}: {matched}/{} golden cases match",
        golden.cases.len()
    );
    assert!(
        matched >= 7,
        "{model}: expected at least 7 cases, got {matched}"
    );
    matched
}

#[test]
fn smollm2_golden_renders_match_transformers_byte_for_byte() {
    check_model("smollm2-135m");
}

#[test]
fn qwen_coder_0_5b_golden_renders_match_transformers_byte_for_byte() {
    check_model("qwen2.5-coder-0.5b");
}

#[test]
fn qwen_coder_1_5b_golden_renders_match_transformers_byte_for_byte() {
    check_model("qwen2.5-coder-1.5b");
}

#[test]
fn qwen_templates_select_the_hermes_tool_format_and_smollm_none() {
    for model in ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"] {
        let (source, _, _) = model_template(model);
        let format = detect_format(&source).expect("Qwen teaches <tool_call>");
        assert_eq!(format.name(), "hermes");
    }
    let (source, _, _) = model_template("smollm2-135m");
    assert!(detect_format(&source).is_none());
}

#[test]
fn model_bos_eos_strings_are_read_from_the_token_table() {
    let (_, bos, eos) = model_template("qwen2.5-coder-0.5b");
    assert_eq!(
        (bos.as_str(), eos.as_str()),
        ("<|endoftext|>", "<|im_end|>")
    );
    let (_, bos, eos) = model_template("smollm2-135m");
    assert_eq!((bos.as_str(), eos.as_str()), ("<|im_start|>", "<|im_end|>"));
}
