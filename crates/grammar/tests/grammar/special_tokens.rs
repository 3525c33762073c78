//! G4: special tokens (BOS, EOS before accepting, control, chat markers, padding) never
//! appear in a mask of a text constraint, on both vocabularies.

use lockstep_grammar::{Constraint, GrammarMatcher};
use sampling::TokenMask;
use text::TokenKind;

use crate::common::*;
use crate::regex_lark::{APPLY_PATCH, FILE_PATH};

fn forbidden_ids(m: &Model) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..m.tok.vocab_size() as u32)
        .filter(|&t| {
            matches!(
                m.tok.token_kind(t),
                Some(TokenKind::Control | TokenKind::Unknown | TokenKind::Unused)
            ) || m.tok.is_never_sample(t)
        })
        .collect();
    ids.extend(m.tok.bos_id());
    for name in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] {
        ids.extend(m.tok.token_to_id(name));
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Walks the matcher and checks every mask: no forbidden id, except EOS exactly where the
/// constraint accepts.
fn check_masks(m: &Model, matcher: &mut GrammarMatcher, rng: &mut Rng, steps: usize, what: &str) {
    let forbidden = forbidden_ids(m);
    let mut mask = TokenMask::new(m.env.n_logits());
    for step in 0..steps {
        if matcher.is_finished() {
            break;
        }
        matcher.compute_mask(&mut mask).expect("mask");
        let accepting = matcher.is_accepting();
        for &t in &forbidden {
            if m.env.is_eos(t) && accepting {
                continue;
            }
            assert!(
                !mask.get(t),
                "{what}: step {step}: special/padding token {t} ({:?}) allowed",
                m.tok.token_text(t)
            );
        }
        let choices: Vec<u32> = mask.iter().filter(|&t| !m.env.is_eos(t)).collect();
        if choices.is_empty() {
            break;
        }
        let t = choices[rng.below(choices.len())];
        matcher.consume(t).expect("consume");
    }
}

#[test]
fn permissive_and_filename_constraints_never_allow_special_tokens() {
    let constraints = [
        ("(.+)", Constraint::regex("(.+)")),
        ("(?s:.*)", Constraint::regex("(?s:.*)")),
        (
            "filename",
            Constraint::lark("start: FILENAME\nFILENAME: /[^\\/\\n]+(\\/[^\\/\\n]+)*/\n"),
        ),
        ("file path", Constraint::lark(FILE_PATH)),
        ("apply_patch", Constraint::lark(APPLY_PATCH)),
        ("negated regex", Constraint::lark("start: X\nX: ~/abc/\n")),
        ("json object", Constraint::json_object()),
    ];
    for (mi, m) in [smollm(), qwen()].into_iter().enumerate() {
        assert!(!forbidden_ids(m).is_empty());
        for (ci, (what, c)) in constraints.iter().enumerate() {
            let compiled = compile(m, c);
            let mut rng = Rng::new((mi * 100 + ci) as u64);
            for _ in 0..3 {
                let mut matcher = compiled.matcher();
                check_masks(m, &mut matcher, &mut rng, 25, what);
            }
        }
    }
}

#[test]
fn eos_is_allowed_only_where_the_constraint_accepts_and_every_eos_id_works() {
    let m = qwen();
    assert!(m.env.eos_ids().len() >= 2, "{:?}", m.env.eos_ids());
    let compiled = compile(m, &Constraint::regex("(.+)"));
    let mut matcher = compiled.matcher();
    assert!(!eos_allowed(m, &mut matcher), "EOS allowed before any text");
    assert_eq!(feed_text(m, &mut matcher, "x"), None);
    let mut mask = TokenMask::new(m.env.n_logits());
    matcher.compute_mask(&mut mask).expect("mask");
    for &e in m.env.eos_ids() {
        assert!(mask.get(e), "EOS {e} not allowed at an accepting point");
        let mut fork = matcher.fork();
        fork.consume(e).expect("every EOS id ends the output");
        assert!(fork.is_finished());
    }
}

#[test]
fn chat_marker_text_is_plain_text_never_the_control_token() {
    for m in [smollm(), qwen()] {
        let marker = m.tok.token_to_id("<|im_start|>").expect("ChatML vocab");
        let compiled = compile(m, &Constraint::regex(r"<\|im_start\|>user"));
        let mut matcher = compiled.matcher();
        assert!(
            !matcher.accepts(marker),
            "control token accepted for marker text"
        );
        assert_eq!(feed_text(m, &mut matcher, "<|im_start|>user"), None);
        assert!(eos_allowed(m, &mut matcher));
    }
}

#[test]
fn padding_and_ids_past_the_vocabulary_are_blocked() {
    let m = qwen();
    let pads: Vec<u32> = (0..m.tok.vocab_size() as u32)
        .filter(|&t| m.tok.token_kind(t) == Some(TokenKind::Unused))
        .collect();
    assert!(!pads.is_empty(), "Qwen has padding entries");
    for &p in &pads {
        assert!(m.env.blocked().get(p));
    }
    let wide = lockstep_grammar::TokenEnv::with_logit_width(m.tok.clone(), m.tok.vocab_size() + 64)
        .expect("wider env");
    assert_eq!(wide.n_logits(), m.tok.vocab_size() + 64);
    let compiled = Constraint::regex("(?s:.*)")
        .compile(&wide, &lockstep_grammar::GrammarLimits::default())
        .expect("compile");
    let mut matcher = compiled.matcher();
    let mut mask = TokenMask::new(0);
    matcher.compute_mask(&mut mask).expect("mask");
    assert_eq!(mask.len(), wide.n_logits());
    for t in m.tok.vocab_size() as u32..wide.n_logits() as u32 {
        assert!(!mask.get(t) && !matcher.accepts(t));
    }
    for &p in &pads {
        assert!(!mask.get(p) && !matcher.accepts(p));
        assert!(matcher.consume(p).is_err());
    }
}
