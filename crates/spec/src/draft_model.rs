//! The draft-model drafter: a smaller model with the same tokenizer on any
//! [`ForwardBackend`], its own paged KV kept in step with the committed tokens, proposing
//! with the target's sampling rule and the same counter-based noise (coupling), masked by
//! the grammar mirror.

use crate::SpecError;
use crate::drafter::{DraftContext, DraftProposal, Drafter, DrafterKind, Mirror};
use model::{ForwardBackend, ForwardRow, KvSlot};
use sampling::Sampler;
use std::sync::{Arc, Mutex, MutexGuard};
use text::Tokenizer;

/// Checks that a draft model's tokenizer is the target's: same vocabulary size, the same
/// bytes and kind (special tokens included) for every id, the same BOS/EOS ids.
pub fn check_same_tokenizer(target: &Tokenizer, draft: &Tokenizer) -> Result<(), SpecError> {
    let mismatch = |what: String| Err(SpecError::TokenizerMismatch(what));
    if target.vocab_size() != draft.vocab_size() {
        return mismatch(format!(
            "vocabulary sizes differ: target {} tokens, draft {} tokens",
            target.vocab_size(),
            draft.vocab_size()
        ));
    }
    for id in 0..target.vocab_size() as u32 {
        if target.token_bytes(id) != draft.token_bytes(id) {
            return mismatch(format!("token {id} has different bytes"));
        }
        if target.token_kind(id) != draft.token_kind(id) {
            return mismatch(format!(
                "token {id} is {:?} in the target but {:?} in the draft (special tokens differ)",
                target.token_kind(id),
                draft.token_kind(id)
            ));
        }
    }
    if target.eos_ids() != draft.eos_ids() || target.bos_id() != draft.bos_id() {
        return mismatch("BOS/EOS tokens differ".into());
    }
    Ok(())
}

/// A loaded draft model on any backend and its KV pool, shared by the per-sequence
/// [`DraftModelDrafter`]s. It runs through the backend contract
/// ([`model::ForwardBackend`]), so a draft model runs wherever a target can (the CPU
/// model, a CUDA device).
pub struct DraftModel {
    backend: Mutex<Box<dyn ForwardBackend>>,
    n_ctx: usize,
    n_vocab: usize,
    name: String,
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel")
            .field("name", &self.name)
            .field("n_vocab", &self.n_vocab)
            .field("n_ctx", &self.n_ctx)
            .finish()
    }
}

impl DraftModel {
    /// Wraps `backend` (a model whose tokenizer is `draft_tok`) as a draft for a target
    /// with tokenizer `target_tok` and logit width `target_vocab`, and makes its KV pool of
    /// `kv_tokens` slots ([`ForwardBackend::init_kv`]). Refuses a different tokenizer or
    /// logit width with a clear error.
    pub fn new(
        name: impl Into<String>,
        mut backend: Box<dyn ForwardBackend>,
        draft_tok: &Tokenizer,
        target_tok: &Tokenizer,
        target_vocab: usize,
        kv_tokens: usize,
    ) -> Result<Arc<DraftModel>, SpecError> {
        check_same_tokenizer(target_tok, draft_tok)?;
        let n = backend.n_vocab();
        if n != target_vocab {
            return Err(SpecError::TokenizerMismatch(format!(
                "logit widths differ: target {target_vocab}, draft {n}"
            )));
        }
        backend
            .init_kv(kv_tokens)
            .map_err(|e| SpecError::DraftModel(e.to_string()))?;
        Ok(Arc::new(DraftModel {
            n_ctx: backend.max_context(),
            n_vocab: n,
            backend: Mutex::new(backend),
            name: name.into(),
        }))
    }

    /// The draft model's display name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The positions the draft model holds (its backend's context).
    pub fn context_len(&self) -> usize {
        self.n_ctx
    }

    /// A drafter for one sequence.
    pub fn drafter(self: &Arc<Self>) -> DraftModelDrafter {
        DraftModelDrafter {
            dm: self.clone(),
            seq: None,
            cached: Vec::new(),
            sampler: Sampler::new(),
            logits: Vec::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Box<dyn ForwardBackend>> {
        self.backend.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One sequence's draft-model state: its KV slot in the shared pool and the tokens that
/// KV holds.
pub struct DraftModelDrafter {
    dm: Arc<DraftModel>,
    seq: Option<KvSlot>,
    /// Tokens whose KV is in `seq` (positions `0..cached.len()`).
    cached: Vec<u32>,
    sampler: Sampler,
    logits: Vec<f32>,
}

impl std::fmt::Debug for DraftModelDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModelDrafter")
            .field("model", &self.dm.name)
            .field("cached", &self.cached.len())
            .finish()
    }
}

/// Rows per draft-model prefill forward.
const CHUNK: usize = 256;

impl DraftModelDrafter {
    /// Runs `tokens[from..]` through the draft model (positions `from..`), leaving the last
    /// row's logits in `self.logits`. On failure the sequence's KV is dropped.
    fn run(&mut self, backend: &mut dyn ForwardBackend, tokens: &[u32], from: usize) -> bool {
        let slot = *self.seq.get_or_insert_with(|| backend.kv_new());
        backend.kv_truncate(slot, from);
        self.cached.truncate(from);
        let mut start = from;
        while start < tokens.len() {
            let end = (start + CHUNK).min(tokens.len());
            let rows: Vec<ForwardRow> = (start..end)
                .map(|pos| ForwardRow {
                    slot,
                    token: tokens[pos],
                    pos,
                    wants_logits: pos + 1 == tokens.len(),
                })
                .collect();
            let r = backend
                .kv_prepare(slot, start, end)
                .and_then(|()| backend.forward(&rows, &mut self.logits));
            if r.is_err() {
                if let Some(s) = self.seq.take() {
                    backend.kv_release(s);
                }
                self.cached.clear();
                return false;
            }
            self.cached.extend_from_slice(&tokens[start..end]);
            start = end;
        }
        true
    }
}

impl Drafter for DraftModelDrafter {
    fn kind(&self) -> DrafterKind {
        DrafterKind::DraftModel
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let mut out = DraftProposal::default();
        let k = ctx.max_draft.min(ctx.max_tokens);
        let l = ctx.tokens.len();
        if k == 0 || l == 0 || l >= self.dm.n_ctx {
            return out;
        }
        let dm = self.dm.clone();
        let mut st = dm.lock();
        // Keep the KV of the common prefix; recompute at least the last committed token.
        let common = self
            .cached
            .iter()
            .zip(ctx.tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(l - 1);
        if !self.run(st.as_mut(), ctx.tokens, common) {
            return out;
        }
        let mut generated: Vec<u32> = ctx.tokens[ctx.prompt_len.min(l)..].to_vec();
        let mut all: Vec<u32> = ctx.tokens.to_vec();
        for j in 0..k {
            let Some(allowed) = mirror.allowed() else {
                break;
            };
            let Some(choice) =
                ctx.coupled_choice(&mut self.sampler, &self.logits, &generated, l + j, allowed)
            else {
                break;
            };
            let t = choice.token;
            if choice.logprob.exp() < ctx.bar(j) || !mirror.advance(t) {
                break;
            }
            out.tokens.push(t);
            generated.push(t);
            all.push(t);
            if ctx.ends(t) || j + 1 == k || l + j + 1 >= self.dm.n_ctx {
                break;
            }
            if !self.run(st.as_mut(), &all, l + j) {
                break;
            }
        }
        if !out.tokens.is_empty() {
            out.source = Some(DrafterKind::DraftModel);
        }
        out
    }

    fn observe(&mut self, committed: &[u32]) {
        // Forget KV beyond the committed prefix (rejected drafts); the next proposal
        // recomputes from the first difference.
        let common = self
            .cached
            .iter()
            .zip(committed)
            .take_while(|(a, b)| a == b)
            .count();
        if common < self.cached.len() {
            self.cached.truncate(common);
            if let Some(slot) = self.seq {
                self.dm.lock().kv_truncate(slot, common);
            }
        }
    }
}

impl Drop for DraftModelDrafter {
    fn drop(&mut self) {
        if let Some(slot) = self.seq.take() {
            self.dm.lock().kv_release(slot);
        }
    }
}
