//! What the timing examples share: a model loaded with its KV cache and scratch, the
//! synthetic token stream they feed it, and one timed prefill or decode measurement.
//! (`examples/common/` holds no `main.rs`, so cargo does not take it for an example.)

// Each example uses the part it needs.
#![allow(dead_code)]

use lockstep_model::{BatchRow, ForwardScratch, KvCache, LoadOptions, Model, SeqKv};
use std::sync::Arc;
use std::time::Instant;

/// A model ready to run forwards: 1,024 tokens of context and KV cache.
pub struct Bench {
    pub model: Model,
    pub kv: KvCache,
    pub scratch: ForwardScratch,
    pub logits: Vec<f32>,
    n_vocab: u32,
}

impl Bench {
    /// Fetches (if needed) and loads the known model `name` with `threads` forward threads.
    pub fn load(name: &str, threads: usize) -> Result<Bench, Box<dyn std::error::Error>> {
        let path = hub::ensure_model(name)?;
        let gguf = Arc::new(gguf::GgufFile::open(path)?);
        let opts = LoadOptions {
            threads: Some(threads),
            n_ctx: Some(1024),
            ..LoadOptions::default()
        };
        let model = Model::load(gguf, &opts)?;
        let n_vocab = model.config().n_vocab as u32;
        let kv = model.new_kv_cache(1024)?;
        let scratch = model.new_scratch();
        Ok(Bench {
            model,
            kv,
            scratch,
            logits: Vec::new(),
            n_vocab,
        })
    }

    /// The synthetic token at position `i` (a fixed stream inside the first 30,000 ids).
    pub fn token(&self, i: usize) -> u32 {
        (i as u32 * 7919 + 13) % self.n_vocab.min(30_000)
    }

    /// Rows for positions `from..to` of sequence 0; with `last_logits` only the last wants
    /// logits, else every row does.
    pub fn rows(&self, from: usize, to: usize, last_logits: bool) -> Vec<BatchRow> {
        (from..to)
            .map(|pos| BatchRow {
                seq: 0,
                token: self.token(pos),
                pos,
                wants_logits: !last_logits || pos + 1 == to,
            })
            .collect()
    }

    /// One forward of `rows` for `seq` (sequence 0 of the batch), logits into `self.logits`.
    pub fn forward(
        &mut self,
        seq: &mut SeqKv,
        rows: &[BatchRow],
    ) -> Result<(), Box<dyn std::error::Error>> {
        self.model.forward(
            &mut self.scratch,
            &mut self.kv,
            &mut [seq],
            rows,
            &mut self.logits,
        )?;
        Ok(())
    }

    /// One measurement on a fresh sequence, tokens/s: one 256-row prefill (`prefill`), else
    /// 48 single-row decode forwards.
    pub fn measure(&mut self, prefill: bool) -> Result<f64, Box<dyn std::error::Error>> {
        let mut seq = self.model.new_sequence(&self.kv);
        let t = Instant::now();
        let n = if prefill {
            let rows = self.rows(0, 256, true);
            self.forward(&mut seq, &rows)?;
            256
        } else {
            for pos in 0..48 {
                let row = self.rows(pos, pos + 1, false);
                self.forward(&mut seq, &row)?;
            }
            48
        };
        let speed = n as f64 / t.elapsed().as_secs_f64();
        self.kv.release_sequence(seq);
        Ok(speed)
    }
}
