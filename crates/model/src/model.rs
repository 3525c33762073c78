//! [`Model`]: a loaded architecture, its thread pool and RoPE table, and the batched
//! forward over rows of one or several sequences.

use crate::ModelError;
use crate::config::{Arch, Config};
use crate::gemma3::Gemma3;
use crate::layers::{Ctx, ForwardScratch};
use crate::llama::Llama;
use backend_cpu::{
    AttnRow, DEFAULT_BLOCK_SIZE, KvCache, KvConfig, KvType, RopeTable, SeqKv, ThreadPool,
};
use gguf::GgufFile;
use std::sync::Arc;

/// How to load a model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Threads for the forward (the caller counts as one); `None` = one per core. Never
    /// more than the machine's cores (see [`Model::with_thread_pool`] to override).
    pub threads: Option<usize>,
    /// Element type of the KV cache.
    pub kv_type: KvType,
    /// Context length (largest position + 1 a row may have); `None` = the trained context
    /// (`context_length`). Larger than the trained context is refused.
    pub n_ctx: Option<usize>,
}

/// One row of a forward batch: a token of one sequence at an absolute position.
///
/// Rows of one sequence must be consecutive positions in row order (a prefill chunk, a
/// single decode row or a verify block); rows of different sequences may interleave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRow {
    /// Index of the row's sequence in the `seqs` slice passed to [`Model::forward`].
    pub seq: usize,
    /// Token id (below [`Config::n_vocab`]).
    pub token: u32,
    /// Absolute position of the token in its sequence.
    pub pos: usize,
    /// Whether the caller wants this row's logits.
    pub wants_logits: bool,
}

/// The weights of one of the supported architectures.
#[derive(Debug)]
enum Weights {
    /// llama and qwen2.
    Llama(Llama),
    /// gemma3.
    Gemma3(Gemma3),
}

/// A loaded model: configuration, packed weights (and the mapped file), thread pool and
/// RoPE table. Immutable once loaded; [`Model::forward`] takes `&self`.
#[derive(Debug)]
pub struct Model {
    gguf: Arc<GgufFile>,
    config: Config,
    weights: Weights,
    pool: ThreadPool,
    rope: RopeTable,
    /// The table of the sliding-window layers where their base differs (gemma3).
    rope_swa: Option<RopeTable>,
    n_ctx: usize,
    kv_type: KvType,
}

impl Model {
    /// Loads the model in `gguf`: reads the [`Config`], checks every tensor's shape and
    /// type, and builds the thread pool and the RoPE table for the context. The weights
    /// stay in the mapped file (no copy); the model keeps `gguf` alive.
    pub fn load(gguf: Arc<GgufFile>, opts: &LoadOptions) -> Result<Model, ModelError> {
        if gguf.architecture().ok() == Some("deepseek4") {
            return Err(ModelError::Config(
                "deepseek4 keeps per-sequence compressor state instead of a paged KV cache: \
                 load it with Deepseek4::load"
                    .into(),
            ));
        }
        let config = Config::from_gguf(&gguf)?;
        let n_ctx = opts.n_ctx.unwrap_or(config.n_ctx_train);
        if n_ctx == 0 || n_ctx > config.n_ctx_train {
            return Err(ModelError::Config(format!(
                "context length {n_ctx} must be in 1..={} (the model's trained context)",
                config.n_ctx_train
            )));
        }
        let weights = match config.arch {
            Arch::Llama | Arch::Qwen2 => Weights::Llama(Llama::load(&config, &gguf)?),
            Arch::Gemma3 => Weights::Gemma3(Gemma3::load(&config, &gguf)?),
        };
        let rope = RopeTable::new(
            f64::from(config.rope_base),
            config.n_rot,
            f64::from(config.rope_scaling.factor()),
            n_ctx,
        )?;
        // Sliding-window layers rotate with their own base and no scaling (llama.cpp's
        // `rope_freq_base_train_swa`, `rope_freq_scale_train_swa = 1`).
        let rope_swa = if config.max_window().is_some() {
            Some(RopeTable::new(
                f64::from(config.rope_base_swa),
                config.n_rot,
                1.0,
                n_ctx,
            )?)
        } else {
            None
        };
        Ok(Model {
            gguf,
            config,
            weights,
            pool: ThreadPool::for_machine(opts.threads),
            rope,
            rope_swa,
            n_ctx,
            kv_type: opts.kv_type,
        })
    }

    /// Replaces the thread pool (any size: tests use more threads than cores to check
    /// that results do not depend on the thread count).
    pub fn with_thread_pool(mut self, pool: ThreadPool) -> Model {
        self.pool = pool;
        self
    }

    /// The thread pool the forward runs on (its spin time and chunk sharing can be tuned
    /// for measurements; results never depend on them).
    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// The hyperparameters.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The context length: rows must have positions below it.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Threads a forward runs on.
    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// The mapped model file.
    pub fn gguf(&self) -> &Arc<GgufFile> {
        &self.gguf
    }

    /// Bytes of the weight matrices the forward reads.
    pub fn weight_bytes(&self) -> usize {
        match &self.weights {
            Weights::Llama(w) => w.weight_bytes(),
            Weights::Gemma3(w) => w.weight_bytes(),
        }
    }

    /// The KV-cache shape of this model with a pool of `max_tokens` token slots (rounded up
    /// to whole blocks of [`DEFAULT_BLOCK_SIZE`]): one window per layer
    /// ([`Config::layer_windows`]). Every pool gets `max_tokens` slots — a sliding group then
    /// never runs out before the global one, whatever the caller does; callers that drop
    /// blocks outside the window ([`KvCache::release_outside_window`]) may give the
    /// sliding groups a smaller pool and grow it ([`KvCache::grow_pool`]), as the engine
    /// does.
    pub fn kv_config(&self, max_tokens: usize) -> KvConfig {
        let blocks = max_tokens.div_ceil(DEFAULT_BLOCK_SIZE);
        let any_window = self.config.max_window().is_some();
        KvConfig {
            n_kv_head: self.config.n_head_kv,
            head_dim: self.config.head_dim,
            block_size: DEFAULT_BLOCK_SIZE,
            kv_type: self.kv_type,
            windows: self.config.layer_windows.clone(),
            global_blocks: blocks,
            sliding_blocks: if any_window { blocks } else { 0 },
        }
    }

    /// A KV cache with room for `max_tokens` token slots over all sequences. Each
    /// sequence holds whole blocks of [`DEFAULT_BLOCK_SIZE`] tokens, so give one block of
    /// slack per concurrent sequence.
    pub fn new_kv_cache(&self, max_tokens: usize) -> Result<KvCache, ModelError> {
        Ok(KvCache::new(self.kv_config(max_tokens))?)
    }

    /// A new, empty sequence of `kv` (give it back with [`KvCache::release_sequence`]).
    pub fn new_sequence(&self, kv: &KvCache) -> SeqKv {
        kv.new_sequence()
    }

    /// Empty scratch buffers for [`Model::forward`].
    pub fn new_scratch(&self) -> ForwardScratch {
        ForwardScratch::new()
    }

    /// One batched forward.
    ///
    /// `rows[i].seq` indexes `seqs`. For each sequence in the batch, its rows must be
    /// consecutive positions `p0, p0+1, …` (in row order) and `p0` must not exceed the
    /// positions already cached (`seqs[j].len()`): the sequence is first cut back to `p0`
    /// (rewriting positions is allowed, leaving gaps is not), its blocks are reserved up
    /// to the last row and shared blocks are copied before they are written, then every
    /// row's K/V is written and attended. Afterwards `seqs[j].len()` is its last row's
    /// position + 1.
    ///
    /// `logits_out` receives, in row order, `n_vocab` logits for each row with
    /// `wants_logits` (it is cleared first). A row's logits do not depend on the other
    /// rows of the batch, on how a sequence's tokens were split into forwards, or on the
    /// thread count (bit-identical, G1).
    ///
    /// Errors: [`ModelError::ContextOverflow`] for a position at or beyond
    /// [`Model::n_ctx`], [`ModelError::Batch`] for a malformed batch (both before anything
    /// changes), and KV-cache errors such as a full block pool ([`ModelError::Backend`];
    /// sequences may then have been cut back to their first batch position).
    pub fn forward(
        &self,
        scratch: &mut ForwardScratch,
        kv: &mut KvCache,
        seqs: &mut [&mut SeqKv],
        rows: &[BatchRow],
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        logits_out.clear();
        self.validate(scratch, seqs, rows)?;
        if rows.is_empty() {
            return Ok(());
        }
        for (seq, span) in seqs.iter_mut().zip(&scratch.spans) {
            let Some((first, last)) = *span else { continue };
            kv.truncate(seq, first);
            kv.reserve(seq, last + 1)?;
            kv.make_writable(seq, first)?;
        }
        let attn_rows: Vec<AttnRow<'_>> = rows
            .iter()
            .map(|r| AttnRow {
                seq: &*seqs[r.seq],
                pos: r.pos,
            })
            .collect();
        let cx = Ctx {
            pool: &self.pool,
            qk: quant::kernels(),
            ops: backend_cpu::Kernels::selected(),
            gguf: &self.gguf,
            cfg: &self.config,
            rope: &self.rope,
            rope_swa: self.rope_swa.as_ref().unwrap_or(&self.rope),
            rope_style: self.config.arch.rope_style(),
        };
        let mut tokens = std::mem::take(&mut scratch.tokens);
        let result = match &self.weights {
            Weights::Llama(w) => w.forward(&cx, scratch, kv, &attn_rows, &tokens, logits_out),
            Weights::Gemma3(w) => w.forward(&cx, scratch, kv, &attn_rows, &tokens, logits_out),
        };
        tokens.clear();
        scratch.tokens = tokens;
        result
    }

    /// Checks the batch and fills `scratch.positions`, `logit_rows`, `spans` and `tokens`.
    fn validate(
        &self,
        s: &mut ForwardScratch,
        seqs: &[&mut SeqKv],
        rows: &[BatchRow],
    ) -> Result<(), ModelError> {
        s.spans.clear();
        s.spans.resize(seqs.len(), None);
        s.positions.clear();
        s.logit_rows.clear();
        s.tokens.clear();
        let n_vocab = self.config.n_vocab;
        for (i, row) in rows.iter().enumerate() {
            let Some(span) = s.spans.get_mut(row.seq) else {
                return Err(ModelError::Batch(format!(
                    "row {i} names sequence {} but {} sequences were given",
                    row.seq,
                    seqs.len()
                )));
            };
            if row.token as usize >= n_vocab {
                return Err(ModelError::Batch(format!(
                    "row {i}: token id {} is outside the vocabulary (0..{n_vocab})",
                    row.token
                )));
            }
            if row.pos >= self.n_ctx {
                return Err(ModelError::ContextOverflow {
                    row: i,
                    pos: row.pos,
                    n_ctx: self.n_ctx,
                });
            }
            *span = match *span {
                None => Some((row.pos, row.pos)),
                Some((first, last)) if row.pos == last + 1 => Some((first, row.pos)),
                Some((_, last)) => {
                    return Err(ModelError::Batch(format!(
                        "row {i}: sequence {} goes from position {last} to {}; rows of one \
                         sequence must be consecutive positions",
                        row.seq, row.pos
                    )));
                }
            };
            s.positions.push(row.pos);
            s.tokens.push(row.token);
            if row.wants_logits {
                s.logit_rows.push(i);
            }
        }
        for (j, (seq, span)) in seqs.iter().zip(&s.spans).enumerate() {
            if let Some((first, _)) = *span
                && first > seq.len()
            {
                return Err(ModelError::Batch(format!(
                    "sequence {j}: first row is at position {first} but only positions \
                     0..{} are cached; positions cannot be skipped",
                    seq.len()
                )));
            }
        }
        Ok(())
    }
}
