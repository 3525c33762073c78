//! The matcher contract: `accepts` ⇔ mask ⇔ `consume` succeeds; forks are independent;
//! rollback restores state; forced tokens cover literals; think blocks; typed errors.

use std::sync::Arc;

use lockstep_grammar::{Constraint, GrammarError, GrammarLimits, GrammarMatcher, TokenEnv};
use sampling::TokenMask;
use serde_json::json;
use text::{EncodeOptions, Tokenizer, VocabSpec};

use crate::common::*;

fn mask_of(m: &Model, matcher: &mut GrammarMatcher) -> TokenMask {
    let mut mask = TokenMask::new(m.env.n_logits());
    matcher.compute_mask(&mut mask).expect("mask");
    mask
}

/// Every token of the vocabulary: `accepts` equals the mask, and a forked `consume` succeeds
/// exactly for the allowed ones (checked on a sample, consumption being costlier).
fn check_contract(m: &Model, matcher: &mut GrammarMatcher, rng: &mut Rng, what: &str) {
    let mask = mask_of(m, matcher);
    for t in 0..m.env.n_logits() as u32 {
        assert_eq!(
            matcher.accepts(t),
            mask.get(t),
            "{what}: accepts({t}) vs mask"
        );
    }
    let allowed: Vec<u32> = mask.iter().collect();
    for _ in 0..20 {
        let t = if rng.chance(0.5) && !allowed.is_empty() {
            allowed[rng.below(allowed.len())]
        } else {
            rng.below(m.env.n_logits()) as u32
        };
        let mut fork = matcher.fork();
        assert_eq!(
            fork.consume(t).is_ok(),
            mask.get(t),
            "{what}: consume({t}) vs mask"
        );
    }
}

#[test]
fn accepts_consume_and_mask_agree_on_every_token() {
    let m = smollm();
    let mut rng = Rng::new(99);
    let constraints = [
        Constraint::json_schema(
            json!({"type": "object", "properties": {"name": {"type": "string"},
            "n": {"type": "integer", "minimum": 0}}, "required": ["name", "n"], "additionalProperties": false}),
        ),
        Constraint::regex("(yes|no), because [a-z ]{1,30}\\."),
        Constraint::json_schema(json!({"const": "a long forced literal value"})),
    ];
    for c in constraints {
        let compiled = compile(m, &c);
        let mut matcher = compiled.matcher();
        for step in 0..6 {
            check_contract(
                m,
                &mut matcher,
                &mut rng,
                &format!("{:?} step {step}", c.source()),
            );
            let mask = mask_of(m, &mut matcher);
            let choices: Vec<u32> = mask.iter().filter(|&t| !m.env.is_eos(t)).collect();
            if choices.is_empty() {
                break;
            }
            matcher
                .consume(choices[rng.below(choices.len())])
                .expect("consume");
        }
    }
}

#[test]
fn a_fork_advances_independently_of_the_original() {
    let m = qwen();
    let compiled = compile(m, &Constraint::regex("[a-z]+ [0-9]+"));
    let mut verified = compiled.matcher();
    assert_eq!(feed_text(m, &mut verified, "abc"), None);
    let before = mask_of(m, &mut verified);
    let mut mirror = verified.fork();
    assert_eq!(feed_text(m, &mut mirror, " 12"), None);
    assert!(mirror.is_accepting());
    assert_ne!(mask_of(m, &mut mirror), before);
    assert_eq!(
        mask_of(m, &mut verified),
        before,
        "the fork changed the original"
    );
    assert!(!verified.is_accepting());
    assert!(mirror.num_consumed() > verified.num_consumed());
}

#[test]
fn rollback_restores_the_earlier_state_including_after_eos() {
    let m = qwen();
    let compiled = compile(
        m,
        &Constraint::json_schema(
            json!({"type": "array", "items": {"type": "integer"}, "maxItems": 3}),
        ),
    );
    let mut matcher = compiled.matcher();
    let start = mask_of(m, &mut matcher);
    let ids = m.tok.encode("[1,22,3]", EncodeOptions::plain_text());
    let mut masks = vec![start.clone()];
    for &t in &ids {
        matcher.consume(t).expect("consume");
        masks.push(mask_of(m, &mut matcher));
    }
    let eos = m.env.eos_ids()[1];
    matcher.consume(eos).expect("eos");
    assert!(matcher.is_finished());
    // EOS again after a finished output is allowed (as in the mask) and rolls back too.
    matcher.consume(eos).expect("eos after finish");
    matcher.rollback(2).expect("rollback eos");
    assert!(!matcher.is_finished() || matcher.is_accepting());
    assert_eq!(mask_of(m, &mut matcher), masks[ids.len()]);
    for k in (0..ids.len()).rev() {
        matcher.rollback(1).expect("rollback");
        assert_eq!(
            mask_of(m, &mut matcher),
            masks[k],
            "after rolling back to {k}"
        );
    }
    assert_eq!(matcher.num_consumed(), 0);
    assert_eq!(
        matcher.rollback(1),
        Err(GrammarError::Rollback {
            requested: 1,
            available: 0
        })
    );
}

#[test]
fn a_rejected_token_is_a_typed_error_and_leaves_the_state_unchanged() {
    let m = qwen();
    let compiled = compile(m, &Constraint::regex("[0-9]+"));
    let mut matcher = compiled.matcher();
    let before = mask_of(m, &mut matcher);
    let letter = m.tok.encode("x", EncodeOptions::plain_text())[0];
    match matcher.consume(letter) {
        Err(GrammarError::TokenRejected {
            token, position: 0, ..
        }) => assert_eq!(token, letter),
        other => panic!("{other:?}"),
    }
    assert_eq!(mask_of(m, &mut matcher), before);
    let n = m.env.n_logits() as u32;
    assert!(matches!(
        matcher.consume(n),
        Err(GrammarError::TokenOutOfRange { .. })
    ));
    assert!(!matcher.accepts(n) && !matcher.accepts(u32::MAX));
    assert_eq!(matcher.num_consumed(), 0);
}

#[test]
fn forced_tokens_cover_a_long_literal_and_are_each_the_only_choice() {
    let m = qwen();
    let literal = "The quick brown fox jumps over the lazy dog, again and again.";
    for c in [
        Constraint::regex(regex_syntax::escape(literal)),
        Constraint::json_schema(json!({"const": literal})),
    ] {
        let compiled = compile(m, &c);
        let mut matcher = compiled.matcher();
        let forced = matcher.forced_tokens();
        assert!(forced.len() >= 8, "{c:?}: forced {forced:?}");
        let mut bytes = Vec::new();
        for &t in &forced {
            let mask = mask_of(m, &mut matcher);
            assert_eq!(
                mask.iter().collect::<Vec<_>>(),
                vec![t],
                "forced token is not the only choice"
            );
            matcher.consume(t).expect("forced token accepted");
            bytes.extend_from_slice(m.env.grammar_bytes(t));
        }
        let text = String::from_utf8(bytes).expect("utf-8");
        let expected = match c.source() {
            lockstep_grammar::ConstraintSource::JsonSchema(_) => format!("\"{literal}\""),
            _ => literal.to_string(),
        };
        assert!(
            expected.starts_with(&text) && text.len() + 4 >= expected.len(),
            "{text:?}"
        );
    }
}

#[test]
fn think_block_with_text_markers_precedes_the_constraint() {
    let m = qwen();
    assert!(m.env.special_token("<think>").is_none());
    let compiled = compile(m, &Constraint::regex("[0-9]+").with_think(true));
    let mut matcher = compiled.matcher();
    assert_eq!(
        feed_text(
            m,
            &mut matcher,
            "<think>\nMaybe 41? No: </thin 42.\n</think>\n\n42"
        ),
        None
    );
    assert!(eos_allowed(m, &mut matcher));
    let mut matcher = compiled.matcher();
    assert!(
        feed_text(m, &mut matcher, "42").is_some(),
        "output without the think block accepted"
    );
    let mut matcher = compiled.matcher();
    let rejected = feed_text(m, &mut matcher, "<think>a</think>b</think>1").is_some();
    assert!(rejected, "a second </think> was accepted as the answer");
    let json = compile(
        m,
        &Constraint::json_schema(
            json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        )
        .with_think(true),
    );
    let mut matcher = json.matcher();
    assert_eq!(
        feed_text(
            m,
            &mut matcher,
            "<think>{\"a\": \"not yet\"}</think>\n{\"a\":1}"
        ),
        None
    );
    assert!(eos_allowed(m, &mut matcher));
}

#[test]
fn think_block_opened_by_the_prompt_starts_inside_the_thoughts() {
    let m = qwen();
    let compiled = compile(m, &Constraint::regex("[0-9]+").with_think_opened());
    let mut matcher = compiled.matcher();
    assert_eq!(
        feed_text(m, &mut matcher, "\nSix times seven.\n</think>\n\n42"),
        None
    );
    assert!(eos_allowed(m, &mut matcher));
    let mut matcher = compiled.matcher();
    assert!(
        feed_text(m, &mut matcher, "42").is_none() && !eos_allowed(m, &mut matcher),
        "an answer before </think> was accepted as complete"
    );
    let mut matcher = compiled.matcher();
    let rejected = feed_text(m, &mut matcher, "a</think>b</think>1").is_some();
    assert!(rejected, "a second </think> was accepted as the answer");
    // `with_think` after `with_think_opened` asks for the whole block again.
    let full = Constraint::regex("1").with_think_opened().with_think(true);
    assert!(full.think() && !full.think_opened());
}

/// GPT-2's byte-to-unicode map.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("char")
}

#[test]
fn think_block_with_special_markers_uses_the_marker_tokens() {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    tokens.extend(["<|endoftext|>", "<think>", "</think>"].map(String::from));
    let mut types = vec![1i32; 256];
    types.extend([3, 3, 3]);
    let spec = VocabSpec {
        model: "gpt2",
        pre: "gpt2",
        tokens: &tokens,
        token_types: &types,
        eos_id: Some(256),
        ..VocabSpec::default()
    };
    let tok = Arc::new(Tokenizer::from_spec(&spec).expect("tokenizer"));
    let env = TokenEnv::new(tok.clone()).expect("env");
    let (open, close) = (257u32, 258u32);
    assert_eq!(env.special_token("<think>"), Some(open));
    let compiled = Constraint::regex("[0-9]+")
        .with_think(true)
        .compile(&env, &GrammarLimits::default())
        .expect("compile");
    let mut matcher = compiled.matcher();
    assert!(
        matcher.accepts(open),
        "the <think> marker token must start the output"
    );
    assert!(!matcher.accepts(tok.encode("<", EncodeOptions::plain_text())[0]));
    matcher.consume(open).expect("open");
    matcher
        .consume_all(&tok.encode("why </think> not", EncodeOptions::plain_text()))
        .expect("free text");
    assert!(matcher.accepts(close));
    matcher.consume(close).expect("close");
    assert!(!matcher.accepts(close));
    matcher
        .consume_all(&tok.encode("\n7", EncodeOptions::plain_text()))
        .expect("answer");
    assert!(matcher.accepts(256));
    // Without think, no constraint allows the marker tokens.
    let plain = Constraint::regex("(?s:.*)")
        .compile(&env, &GrammarLimits::default())
        .expect("compile");
    let mut matcher = plain.matcher();
    assert!(!matcher.accepts(open) && !matcher.accepts(close));
}
