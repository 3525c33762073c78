//! Integration tests of the engine. Here: engine behaviour on the fake backend (batching
//! invariance, prefix reuse, preemption, cancellation, admission control, per-sequence
//! failures, stop conditions and text). In the modules: speculation on the fake backend, on
//! the DeepSeek V4 fixtures (with DSpark) and on real models, all compared with plain
//! decoding through one harness (`harness`); structured output on real models; the disk
//! cache; gemma3's sliding window; batched real-model runs.

mod common;
mod constrained;
mod deepseek4_dspark;
mod deepseek4_spec;
mod disk_cache;
mod gemma3_window;
mod harness;
mod real_model;
mod spec_real;
mod speculation;
mod summaries;

use common::*;
use lockstep_engine::{
    EngineConfig, Event, FakeBackend, FinishReason, GenerateRequest, SamplingParams, StopCause,
    SubmitError,
};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Five requests of different lengths and sampling settings.
fn mixed_requests() -> Vec<GenerateRequest> {
    vec![
        request(prompt(1, 3), SamplingParams::greedy(), 20),
        request(prompt(2, 41), seeded(0.8, 7), 17),
        request(prompt(3, 70), seeded(1.3, 99), 25),
        request(
            prompt(4, 5),
            SamplingParams {
                top_k: 5,
                repetition_penalty: 1.2,
                ..seeded(0.7, 3)
            },
            30,
        ),
        request(prompt(5, 130), SamplingParams::greedy(), 9),
    ]
}

#[test]
fn engine_output_equals_the_reference_decode_of_the_sampling_rule() {
    let reqs = mixed_requests();
    let expected: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| reference_decode(&r.prompt, &r.sampling, r.max_tokens.unwrap(), None))
        .collect();
    let got = run_alone(reqs);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(&g.tokens, e, "request {i}");
        assert_eq!(g.finish, Some(FinishReason::Length));
        assert_eq!(g.logit_sha256.len(), e.len());
    }
}

#[test]
fn mixed_concurrent_sequences_are_bit_identical_to_each_run_alone() {
    let alone = run_alone(mixed_requests());
    let (engine, stats) = engine(config());
    // Started at different times: two now, the rest once the first has produced tokens.
    let mut reqs = mixed_requests().into_iter();
    let h0 = engine.submit(reqs.next().unwrap()).unwrap();
    let h1 = engine.submit(reqs.next().unwrap()).unwrap();
    let first = h0.recv();
    assert!(matches!(first, Some(Event::Token { .. })));
    let rest: Vec<_> = reqs.map(|r| engine.submit(r).unwrap()).collect();
    let mut c0 = h0.collect();
    if let Some(Event::Token {
        token,
        text,
        logprob,
        logit_sha256,
        ..
    }) = first
    {
        c0.tokens.insert(0, token);
        c0.text.insert_str(0, &text);
        c0.logprobs.insert(0, logprob);
        c0.logit_sha256.insert(0, logit_sha256.unwrap());
    }
    let mut got = vec![c0, h1.collect()];
    got.extend(rest.into_iter().map(|h| h.collect()));
    for (i, (a, b)) in alone.iter().zip(&got).enumerate() {
        assert_same(a, b, &format!("request {i}"));
    }
    assert!(
        stats.max_seqs_in_forward.load(Ordering::SeqCst) >= 3,
        "forwards really mixed several sequences"
    );
    let m = engine.metrics();
    assert!(m.mean_rows_per_step > 1.0, "{m:?}");
    assert!(m.mean_batch_occupancy > 0.0 && m.mean_step_ms >= 0.0);
    engine.shutdown();
}

#[test]
fn step_budget_and_prefill_chunks_bound_every_forward() {
    let cfg = EngineConfig {
        step_token_budget: 10,
        prefill_chunk: 4,
        ..config()
    };
    let alone = run_alone(mixed_requests());
    let (engine, stats) = engine(cfg);
    let handles: Vec<_> = mixed_requests()
        .into_iter()
        .map(|r| engine.submit(r).unwrap())
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_same(&alone[i], &h.collect(), &format!("request {i}"));
    }
    let m = engine.metrics();
    let forwards = stats.forwards.load(Ordering::SeqCst);
    let rows = stats.rows.load(Ordering::SeqCst);
    assert!(rows <= forwards * 10, "{rows} rows in {forwards} forwards");
    assert_eq!(m.rows_total, rows);
    engine.shutdown();
}

#[test]
fn a_long_prompt_is_chunked_and_never_stalls_a_decoding_sequence() {
    let cfg = EngineConfig {
        step_token_budget: 16,
        prefill_chunk: 8,
        ..config()
    };
    let (engine, stats) = engine(cfg);
    // A decodes until cancelled, so it is running during all of B's prefill.
    let a = engine
        .submit(request(prompt(8, 4), SamplingParams::greedy(), 100_000))
        .unwrap();
    assert!(matches!(a.recv(), Some(Event::Token { .. })));
    let b = engine
        .submit(request(prompt(9, 300), SamplingParams::greedy(), 2))
        .unwrap();
    let cb = b.collect();
    assert_eq!(cb.tokens.len(), 2);
    a.cancel();
    let batches = stats.batches.lock().unwrap().clone();
    // B's prompt went in 37 chunks of 8 (+ 4), each sharing its forward with A's decode row.
    let chunked: Vec<&Vec<usize>> = batches.iter().filter(|b| b.contains(&8)).collect();
    assert_eq!(chunked.len(), 37, "{batches:?}");
    for b in chunked {
        assert_eq!(b, &vec![1, 8], "A decoded in every step of B's prefill");
    }
    assert!(batches.iter().all(|b| b.iter().sum::<usize>() <= 16));
    engine.shutdown();
}

#[test]
fn repeated_prefix_is_reused_with_identical_results_and_counted() {
    let system = prompt(20, 40); // 5 full blocks of 8
    let mut p1 = system.clone();
    p1.extend(prompt(21, 7));
    let mut p2 = system.clone();
    p2.extend(prompt(22, 12));
    let mk = |p: &Vec<u32>| request(p.clone(), seeded(0.9, 5), 12);
    let alone = run_alone(vec![mk(&p1), mk(&p2)]);

    let (engine, stats) = engine(config());
    let c1 = engine.submit(mk(&p1)).unwrap().collect();
    let rows_before = stats.rows.load(Ordering::SeqCst);
    let c2 = engine.submit(mk(&p2)).unwrap().collect();
    let rows_second = stats.rows.load(Ordering::SeqCst) - rows_before;
    assert_same(&alone[0], &c1, "first");
    assert_same(&alone[1], &c2, "second");
    assert_eq!(c1.usage.cached_tokens, 0);
    assert_eq!(c2.usage.cached_tokens, 40);
    // Prompt 52 tokens, 40 reused: 12 prompt rows + 11 decode rows.
    assert_eq!(rows_second, 12 + 11);
    assert_eq!(engine.metrics().prefix_cache_hit_tokens, 40);

    // A continued conversation reuses the generated blocks too.
    let mut p3 = p1.clone();
    p3.extend(&c1.tokens);
    p3.extend(prompt(23, 3));
    let c3 = engine.submit(mk(&p3)).unwrap().collect();
    let alone3 = run_alone(vec![mk(&p3)]);
    assert_same(&alone3[0], &c3, "continued");
    // p1 + 11 generated tokens fed back = 58 positions computed: 7 full blocks.
    assert_eq!(c3.usage.cached_tokens, 56);
    engine.shutdown();
}

#[test]
fn a_fully_cached_prompt_recomputes_only_its_last_token_through_copy_on_write() {
    let p = prompt(30, 32); // exactly 4 blocks
    let mk = || request(p.clone(), seeded(0.5, 11), 10);
    let alone = run_alone(vec![mk()]);
    let (engine, stats) = engine(config());
    let a = engine.submit(mk()).unwrap().collect();
    let before = stats.rows.load(Ordering::SeqCst);
    let b = engine.submit(mk()).unwrap().collect();
    assert_eq!(stats.rows.load(Ordering::SeqCst) - before, 1 + 9);
    assert_same(&alone[0], &a, "first");
    assert_same(&alone[0], &b, "reused");
    assert_eq!(b.usage.cached_tokens, 31);
    // Both in flight at once, sharing the cached blocks.
    let h: Vec<_> = (0..3).map(|_| engine.submit(mk()).unwrap()).collect();
    for x in h {
        assert_same(&alone[0], &x.collect(), "concurrent reuse");
    }
    engine.shutdown();
    assert_eq!(
        stats.free_blocks.load(Ordering::SeqCst),
        4096 / BLOCK as u64,
        "every block back after shutdown"
    );
}

#[test]
fn tiny_kv_pool_preempts_and_recomputes_with_identical_results_and_no_leak() {
    let reqs = || -> Vec<GenerateRequest> {
        (0..5)
            .map(|i| {
                request(
                    prompt(40 + i, 6 + 3 * i as usize),
                    seeded(0.8, i as u64),
                    24,
                )
            })
            .collect()
    };
    let alone = run_alone(reqs());
    for prefix_cache in [false, true] {
        // 8 blocks of 8 tokens: far less than 5 sequences of ~40 tokens need.
        let cfg = EngineConfig {
            kv_tokens: 64,
            prefix_cache,
            ..config()
        };
        let (engine, stats) = engine(cfg);
        let handles: Vec<_> = reqs()
            .into_iter()
            .map(|r| engine.submit(r).unwrap())
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            assert_same(&alone[i], &h.collect(), &format!("request {i}"));
        }
        let m = engine.metrics();
        assert!(m.preemptions > 0, "the pool forced preemptions: {m:?}");
        assert_eq!(m.running, 0);
        if prefix_cache {
            assert!(
                m.evictions > 0,
                "cached blocks were evicted under pressure: {m:?}"
            );
        } else {
            assert_eq!(m.kv_free_blocks, m.kv_total_blocks, "no block leaked");
        }
        engine.shutdown();
        assert_eq!(stats.free_blocks.load(Ordering::SeqCst), 8, "all free");
    }
}

#[test]
fn a_sequence_larger_than_the_pool_fails_alone_and_others_finish() {
    let cfg = EngineConfig {
        kv_tokens: 32, // 4 blocks
        prefix_cache: false,
        ..config()
    };
    let (engine, _) = engine(cfg);
    let big = engine
        .submit(request(prompt(50, 20), SamplingParams::greedy(), 100))
        .unwrap();
    let small = engine
        .submit(request(prompt(51, 3), SamplingParams::greedy(), 4))
        .unwrap();
    let cb = big.collect();
    assert!(
        cb.error.as_deref().unwrap_or("").contains("KV pool"),
        "{cb:?}"
    );
    let cs = small.collect();
    assert_eq!(cs.finish, Some(FinishReason::Length));
    // A prompt that cannot fit at all is refused up front.
    let e = engine
        .submit(request(prompt(52, 40), SamplingParams::greedy(), 1))
        .unwrap_err();
    assert!(
        matches!(e, SubmitError::Invalid(ref m) if m.contains("40 tokens")),
        "{e}"
    );
    engine.shutdown();
}

#[test]
fn cancel_and_drop_free_every_block_at_once() {
    let cfg = EngineConfig {
        prefix_cache: false,
        ..config()
    };
    let (engine, _) = engine(cfg);
    let total = engine.metrics().kv_total_blocks;
    let endless = || request(prompt(60, 50), SamplingParams::greedy(), 100_000);
    let a = engine.submit(endless()).unwrap();
    let b = engine.submit(endless()).unwrap();
    for _ in 0..3 {
        assert!(matches!(a.recv(), Some(Event::Token { .. })));
        assert!(matches!(b.recv(), Some(Event::Token { .. })));
    }
    a.cancel();
    drop(b);
    // The stream of a cancelled request ends without a Finished event.
    while let Some(e) = a.recv() {
        assert!(matches!(e, Event::Token { .. }), "{e:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = engine.metrics();
        if m.running == 0 && m.kv_free_blocks == total {
            assert_eq!(m.requests_cancelled, 2);
            break;
        }
        assert!(Instant::now() < deadline, "blocks not freed: {m:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    engine.shutdown();
}

#[test]
fn a_full_queue_answers_busy_and_accepts_again_later() {
    let cfg = EngineConfig {
        max_seqs: 1,
        queue_capacity: 2,
        ..config()
    };
    let (engine, _) = engine(cfg);
    let running = engine
        .submit(request(prompt(70, 4), SamplingParams::greedy(), 100_000))
        .unwrap();
    assert!(matches!(running.recv(), Some(Event::Token { .. })));
    let q1 = engine
        .submit(request(prompt(71, 4), SamplingParams::greedy(), 2))
        .unwrap();
    let q2 = engine
        .submit(request(prompt(72, 4), SamplingParams::greedy(), 2))
        .unwrap();
    let busy = engine.submit(request(prompt(73, 4), SamplingParams::greedy(), 2));
    assert!(matches!(
        busy,
        Err(SubmitError::Busy {
            queued: 2,
            wanted: 1,
            capacity: 2
        })
    ));
    assert_eq!(engine.metrics().queue_depth, 2);
    // A group that does not fit is refused whole: nothing of it is queued.
    let group = engine.submit_group(vec![
        request(prompt(74, 4), SamplingParams::greedy(), 2),
        request(prompt(75, 4), SamplingParams::greedy(), 2),
    ]);
    assert!(matches!(
        group,
        Err(SubmitError::Busy {
            queued: 2,
            wanted: 2,
            capacity: 2
        })
    ));
    assert_eq!(engine.metrics().queue_depth, 2);
    running.cancel();
    assert_eq!(q1.collect().tokens.len(), 2);
    assert_eq!(q2.collect().tokens.len(), 2);
    assert!(
        engine
            .submit(request(prompt(73, 4), SamplingParams::greedy(), 2))
            .is_ok()
    );
    engine.shutdown();
}

#[test]
fn invalid_requests_are_refused_with_the_numbers() {
    let cfg = EngineConfig {
        context_len: 50,
        ..config()
    };
    let (engine, _) = engine(cfg);
    assert_eq!(engine.context_len(), 50);
    let invalid = |r: GenerateRequest| match engine.submit(r) {
        Err(SubmitError::Invalid(m)) => m,
        other => panic!("expected Invalid, got {other:?}"),
    };
    assert!(invalid(request(vec![], SamplingParams::greedy(), 1)).contains("empty"));
    let m = invalid(request(vec![1, 64], SamplingParams::greedy(), 1));
    assert!(m.contains("64") && m.contains("vocabulary"), "{m}");
    let m = invalid(request(prompt(1, 50), SamplingParams::greedy(), 1));
    assert!(
        m.contains("50 tokens") && m.contains("context is 50"),
        "{m}"
    );
    let m = invalid(request(prompt(1, 5), seeded(-1.0, 0), 1));
    assert!(m.contains("emperature"), "{m}");
    let mut r = request(prompt(1, 5), SamplingParams::greedy(), 1);
    r.stop_strings = vec!["".into()];
    assert!(invalid(r).contains("empty"));
    // Engine configuration is checked at start.
    let bad = lockstep_engine::Engine::start(
        Box::new(FakeBackend::new(N_VOCAB, 100, BLOCK)),
        tokenizer(),
        EngineConfig {
            context_len: 101,
            ..config()
        },
    );
    assert!(bad.is_err());
    engine.shutdown();
}

#[test]
fn a_constraint_error_ends_only_that_sequence() {
    let alone = run_alone(mixed_requests());
    let (engine, _) = engine(config());
    let mut bad = request(prompt(80, 9), SamplingParams::greedy(), 10);
    let mut c = Scripted::new(vec![(1..20).collect(); 10]);
    c.fail_at = Some(3);
    bad.constraint = Some(Box::new(c));
    let hb = engine.submit(bad).unwrap();
    let hs: Vec<_> = mixed_requests()
        .into_iter()
        .map(|r| engine.submit(r).unwrap())
        .collect();
    let cb = hb.collect();
    assert_eq!(cb.tokens.len(), 3);
    assert!(cb.error.unwrap().contains("scripted failure"));
    for (i, h) in hs.into_iter().enumerate() {
        assert_same(&alone[i], &h.collect(), &format!("request {i}"));
    }
    assert_eq!(engine.metrics().requests_failed, 1);
    engine.shutdown();
}

#[test]
fn a_backend_fault_on_one_sequence_does_not_poison_the_batch() {
    let alone = run_alone(mixed_requests());
    let poison = EOS; // no prompt contains it
    let (engine, _) = engine_with(
        FakeBackend::new(N_VOCAB, 1024, BLOCK).fail_on_token(poison),
        config(),
    );
    let mut bad = prompt(90, 10);
    bad[4] = poison;
    let hb = engine
        .submit(request(bad, SamplingParams::greedy(), 5))
        .unwrap();
    let hs: Vec<_> = mixed_requests()
        .into_iter()
        .map(|mut r| {
            // keep the healthy requests away from the poison token
            r.sampling.logit_bias.push((poison, f32::NEG_INFINITY));
            r
        })
        .map(|r| engine.submit(r).unwrap())
        .collect();
    assert!(hb.collect().error.unwrap().contains("injected fault"));
    let healthy: Vec<_> = mixed_requests()
        .into_iter()
        .map(|mut r| {
            r.sampling.logit_bias.push((poison, f32::NEG_INFINITY));
            r
        })
        .collect();
    let alone_biased = run_alone(healthy);
    for (i, h) in hs.into_iter().enumerate() {
        assert_same(&alone_biased[i], &h.collect(), &format!("request {i}"));
    }
    let _ = alone;
    engine.shutdown();
}

#[test]
fn the_constraint_mask_is_honoured_and_its_end_stops_the_sequence() {
    let script: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![4, 5], vec![6, 7, 8, 9], vec![10, 11]];
    let p = prompt(100, 6);
    let params = seeded(1.0, 4);
    let mut reference_c = Scripted::new(script.clone());
    let expected = reference_decode(&p, &params, 10, Some(&mut reference_c));
    let (engine, _) = engine(config());
    let mut r = request(p, params, 10);
    r.constraint = Some(Box::new(Scripted::new(script.clone())));
    let c = engine.submit(r).unwrap().collect();
    assert_eq!(c.tokens, expected);
    assert_eq!(c.tokens.len(), 4);
    for (t, set) in c.tokens.iter().zip(&script) {
        assert!(set.contains(t));
    }
    assert_eq!(c.finish, Some(FinishReason::Stop(StopCause::GrammarEnd)));
    engine.shutdown();
}

#[test]
fn utf8_is_never_split_across_text_deltas() {
    let (engine, _) = engine(config());
    let mut r = request(prompt(110, 4), SamplingParams::greedy(), 10);
    r.constraint = Some(Box::new(Scripted::new(vec![
        vec![BYTE_C3],
        vec![BYTE_A9],
        vec![1],
    ])));
    let h = engine.submit(r).unwrap();
    let texts: Vec<String> = (&h)
        .into_iter()
        .filter_map(|e| match e {
            Event::Token { text, .. } => Some(text),
            _ => None,
        })
        .collect();
    assert_eq!(
        texts,
        vec!["".to_string(), "é".to_string(), "a".to_string()]
    );
    engine.shutdown();
}

#[test]
fn stop_strings_are_held_back_and_never_emitted() {
    let p = prompt(120, 5);
    let free = run_alone(vec![request(p.clone(), SamplingParams::greedy(), 40)]);
    let text = &free[0].text;
    // A stop string from the middle of the free output (3 chars starting at char 10).
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 20, "{text:?}");
    let stop: String = chars[10..13].iter().collect();
    let cut = text.find(&stop).unwrap();
    let (engine, _) = engine(config());
    let mut r = request(p, SamplingParams::greedy(), 40);
    r.stop_strings = vec!["never-there".into(), stop.clone()];
    let h = engine.submit(r).unwrap();
    let mut streamed = String::new();
    let mut reason = None;
    for e in &h {
        match e {
            Event::Token { text, .. } => {
                streamed.push_str(&text);
                assert!(!streamed.contains(&stop), "stop string leaked");
            }
            Event::Finished {
                reason: r, text, ..
            } => {
                streamed.push_str(&text);
                reason = Some(r);
            }
            Event::Error(e) => panic!("{e}"),
        }
    }
    assert_eq!(streamed, text[..cut]);
    assert_eq!(
        reason,
        Some(FinishReason::Stop(StopCause::StopString { index: 1 }))
    );
    engine.shutdown();
}

#[test]
fn eos_stops_the_sequence_unless_ignored() {
    // Find a prompt whose greedy continuation reaches EOS within 60 tokens.
    let (p, at) = (0..2000)
        .find_map(|s| {
            let p = prompt(1000 + s, 4);
            let out = reference_decode(&p, &SamplingParams::greedy(), 60, None);
            out.iter().position(|&t| t == EOS).map(|at| (p, at))
        })
        .expect("some prompt reaches EOS");
    let (engine, _) = engine(config());
    let mut r = request(p.clone(), SamplingParams::greedy(), 60);
    r.ignore_eos = false;
    let c = engine.submit(r).unwrap().collect();
    assert_eq!(c.finish, Some(FinishReason::Stop(StopCause::Eos)));
    assert_eq!(c.tokens.len(), at + 1, "the EOS token is the last one");
    assert_eq!(c.usage.completion_tokens, at + 1);
    let c = engine
        .submit(request(p, SamplingParams::greedy(), 60))
        .unwrap()
        .collect();
    assert_eq!(c.finish, Some(FinishReason::Length));
    assert_eq!(c.tokens.len(), 60);
    engine.shutdown();
}

#[test]
fn the_context_end_finishes_with_context_length() {
    let cfg = EngineConfig {
        context_len: 20,
        ..config()
    };
    let (engine, _) = engine(cfg);
    let mut r = request(prompt(130, 15), SamplingParams::greedy(), 100);
    r.max_tokens = None;
    let c = engine.submit(r).unwrap().collect();
    assert_eq!(c.finish, Some(FinishReason::ContextLength));
    assert_eq!(c.tokens.len(), 5, "positions 15..20");
    engine.shutdown();
}

#[test]
fn max_tokens_zero_finishes_at_once_and_usage_is_reported() {
    let (engine, _) = engine(config());
    let c = engine
        .submit(request(prompt(140, 7), SamplingParams::greedy(), 0))
        .unwrap()
        .collect();
    assert_eq!(c.finish, Some(FinishReason::Length));
    assert!(c.tokens.is_empty());
    assert_eq!(c.usage.prompt_tokens, 7);
    let c = engine
        .submit(request(prompt(141, 7), SamplingParams::greedy(), 3))
        .unwrap()
        .collect();
    assert_eq!(c.usage.completion_tokens, 3);
    assert!(c.timings.ttft_ms >= c.timings.queue_ms);
    assert!(c.timings.decode_ms >= 0.0 && c.timings.prefill_ms >= 0.0);
    let m = engine.metrics();
    assert_eq!(m.requests_finished, 2);
    assert!(m.steps >= 3);
    engine.shutdown();
}

#[test]
fn shutdown_ends_running_requests_with_an_error() {
    let (engine, _) = engine(config());
    let h = engine
        .submit(request(prompt(150, 5), SamplingParams::greedy(), 1_000_000))
        .unwrap();
    assert!(matches!(h.recv(), Some(Event::Token { .. })));
    engine.shutdown();
    let c = h.collect();
    assert_eq!(c.error.as_deref(), Some("engine shut down"));
}
