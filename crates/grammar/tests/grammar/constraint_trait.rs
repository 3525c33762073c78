//! The matcher through the engine's interface, `sampling::TokenConstraint`: `accepts`
//! agrees with the mask on every token of the vocabulary (and `consume` with both) along a
//! walk through several grammars; errors arrive as typed `ConstraintError`s.

use lockstep_grammar::{Constraint, GrammarError, GrammarLimits};
use sampling::{ConstraintError, TokenConstraint, TokenMask, check_contract};
use serde_json::json;
use text::EncodeOptions;

use crate::common::*;

#[test]
fn accepts_agrees_with_the_mask_on_every_token_through_the_trait() {
    let m = smollm();
    let n = m.env.n_logits();
    let mut rng = Rng::new(17);
    let constraints = [
        Constraint::json_schema(json!({"type": "object",
            "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
            "required": ["id", "tags"], "additionalProperties": false})),
        Constraint::regex("[A-Z][a-z]{0,6} = [0-9]{1,3};"),
        Constraint::lark("start: \"say \" WORD (\",\" WORD)*\nWORD: /[a-z]{1,5}/"),
        Constraint::choice(["alpha", "beta", "gamma delta"]),
    ];
    let mut mask = TokenMask::new(0);
    for c in constraints {
        let compiled = compile(m, &c);
        let mut boxed: Box<dyn TokenConstraint> = Box::new(compiled.matcher());
        for step in 0..5 {
            check_contract(boxed.as_mut(), n)
                .unwrap_or_else(|v| panic!("{:?} step {step}: {v}", c.source()));
            // The mirror is a fork through the trait: it keeps the contract too.
            let mut mirror = boxed.fork();
            check_contract(mirror.as_mut(), n)
                .unwrap_or_else(|v| panic!("{:?} fork at step {step}: {v}", c.source()));
            boxed.compute_mask(&mut mask).expect("mask");
            let choices: Vec<u32> = mask.iter().filter(|&t| !m.env.is_eos(t)).collect();
            if choices.is_empty() {
                break;
            }
            boxed
                .consume(choices[rng.below(choices.len())])
                .expect("consume an allowed token");
        }
    }
}

#[test]
fn the_mask_is_refilled_in_place() {
    let m = qwen();
    let mut matcher = compile(m, &Constraint::regex("[0-9]+")).matcher();
    let mut mask = TokenMask::new(m.env.n_logits());
    TokenConstraint::compute_mask(&mut matcher, &mut mask).expect("mask");
    let buffer = mask.words().as_ptr();
    let one = m.tok.encode("1", EncodeOptions::plain_text());
    TokenConstraint::consume(&mut matcher, one[0]).expect("digit");
    TokenConstraint::compute_mask(&mut matcher, &mut mask).expect("mask");
    assert_eq!(mask.words().as_ptr(), buffer, "the mask was reallocated");
    assert_eq!(mask.len(), m.env.n_logits());
}

#[test]
fn driving_errors_are_typed_and_keep_their_messages() {
    let m = qwen();
    let mut matcher = compile(m, &Constraint::regex("[0-9]{2}")).matcher();
    let letter = m.tok.encode("x", EncodeOptions::plain_text())[0];
    let err = TokenConstraint::consume(&mut matcher, letter).unwrap_err();
    assert!(
        matches!(err, ConstraintError::TokenRejected { token, position: 0, .. } if token == letter),
        "{err:?}"
    );
    let direct = matcher.consume(letter).unwrap_err();
    assert_eq!(err.to_string(), direct.to_string());
    assert!(!TokenConstraint::accepts(&mut matcher, letter));
    assert_eq!(
        TokenConstraint::rollback(&mut matcher, 1),
        Err(ConstraintError::Rollback {
            requested: 1,
            available: 0
        })
    );
    let n = m.env.n_logits() as u32;
    assert!(matches!(
        TokenConstraint::consume(&mut matcher, n),
        Err(ConstraintError::TokenOutOfRange { token, .. }) if token == n
    ));
}

#[test]
fn a_bad_grammar_is_an_invalid_constraint_error() {
    let m = qwen();
    for (c, want_too_complex) in [
        (Constraint::lark("start: (("), false),
        (Constraint::regex("(unclosed"), false),
        (
            Constraint::json_schema(json!({"type": "object", "if": {}})),
            false,
        ),
        (Constraint::choice(Vec::<String>::new()), false),
        (Constraint::regex("(a{1000}){100}"), true),
    ] {
        let err: GrammarError = c
            .compile(&m.env, &GrammarLimits::default())
            .expect_err("a bad constraint must not compile");
        let message = err.to_string();
        let as_constraint = ConstraintError::from(err);
        match as_constraint {
            ConstraintError::Invalid(ref msg) if !want_too_complex => {
                assert_eq!(*msg, message)
            }
            ConstraintError::TooComplex(_) if want_too_complex => {}
            other => panic!("{c:?}: {other:?}"),
        }
        assert_eq!(as_constraint.to_string(), message);
    }
}
