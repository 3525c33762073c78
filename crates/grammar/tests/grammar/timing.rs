//! Compile and mask timings for a typical nested schema on the Qwen vocabulary (printed
//! with `--nocapture`; the bounds only catch a pathological regression).

use std::time::{Duration, Instant};

use lockstep_grammar::{Constraint, GrammarLimits};
use sampling::TokenMask;
use serde_json::json;
use text::EncodeOptions;

use crate::common::*;

#[test]
fn nested_schema_compile_and_mask_times_on_qwen() {
    let m = qwen();
    let schema = json!({"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid"},
        "title": {"type": "string", "maxLength": 80},
        "tags": {"type": "array", "items": {"enum": ["bug", "feature", "docs"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}}, "required": ["name", "email"], "additionalProperties": false},
        "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}}, "required": ["sku", "qty"], "additionalProperties": false}},
        "due": {"type": "string", "format": "date"}},
        "required": ["id", "title", "owner", "items"], "additionalProperties": false});
    let c = Constraint::json_schema(schema);
    let mut compile_times = Vec::new();
    let mut compiled = None;
    for _ in 0..5 {
        let t0 = Instant::now();
        compiled = Some(
            c.compile(&m.env, &GrammarLimits::default())
                .expect("compile"),
        );
        compile_times.push(t0.elapsed());
    }
    let compiled = compiled.expect("compiled");
    let instance = r#"{"id":"123e4567-e89b-12d3-a456-426614174000","title":"Fix the parser","tags":["bug","docs"],"owner":{"name":"Ann Lee","email":"ann@example.org","age":41},"items":[{"sku":"ABC-1234","qty":2,"price":9.99},{"sku":"XYZ-0001","qty":1}],"due":"2025-03-01"}"#;
    let ids = m.tok.encode(instance, EncodeOptions::plain_text());
    let mut mask_times = Vec::new();
    let mut accepts_times = Vec::new();
    let mut mask = TokenMask::new(m.env.n_logits());
    for _ in 0..3 {
        let mut matcher = compiled.matcher();
        for &t in &ids {
            let t0 = Instant::now();
            matcher.compute_mask(&mut mask).expect("mask");
            mask_times.push(t0.elapsed());
            assert!(mask.get(t));
            let mut fork = matcher.fork();
            let t0 = Instant::now();
            assert!(fork.accepts(t));
            accepts_times.push(t0.elapsed());
            matcher.consume(t).expect("consume");
        }
    }
    let stats = |v: &mut Vec<Duration>| {
        v.sort();
        let mean = v.iter().sum::<Duration>() / v.len() as u32;
        let p99 = v[(v.len() * 99 / 100).min(v.len() - 1)];
        (mean, p99, v[v.len() - 1])
    };
    let (cm, cp, cmax) = stats(&mut compile_times);
    let (mm, mp, mmax) = stats(&mut mask_times);
    let (am, ap, amax) = stats(&mut accepts_times);
    eprintln!("compile: mean {cm:?} p99 {cp:?} max {cmax:?} (5 runs)");
    eprintln!(
        "mask:    mean {mm:?} p99 {mp:?} max {mmax:?} ({} masks, {} tokens)",
        mask_times.len(),
        ids.len()
    );
    eprintln!("accepts: mean {am:?} p99 {ap:?} max {amax:?}");
    assert!(cm < Duration::from_secs(2), "compile {cm:?}");
    assert!(mm < Duration::from_millis(50), "mask {mm:?}");
}
