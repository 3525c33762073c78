//! The token environment: the model's vocabulary as llguidance sees it, built once per
//! model and shared by every constraint compiled for that model.
//!
//! Each token id maps to the bytes a grammar may produce with it:
//! - text tokens (normal, byte-fallback, user-defined): the bytes they stand for;
//! - control and unknown tokens (BOS, EOS, `<|im_start|>`…): `0xFF` followed by their text.
//!   `0xFF` never occurs in UTF-8, and every terminal of a lockstep constraint matches UTF-8
//!   only, so no regex, JSON string or literal can produce them; a Lark grammar can still name
//!   one on purpose (`<|im_end|>`, `<[151645]>`) — that is llguidance's special-token syntax;
//! - padding/unused entries, never-sample ids, ids past the vocabulary (logit rows wider than
//!   the token list) and byte-duplicates of another token: no bytes at all. They are in the
//!   *blocked* set, removed from every mask and refused by `accepts`/`consume`.
//!
//! End-of-generation ids (all of [`text::Tokenizer::eos_ids`], so Qwen's `<|im_end|>` and
//! `<|endoftext|>` both work) are allowed by a mask only where the constraint accepts.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use llguidance::ParserFactory;
use sampling::TokenMask;
use text::{EncodeOptions, TokenKind, Tokenizer};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::error::GrammarError;

/// llguidance's view of our tokenizer: the trie plus canonical tokenization of forced text.
struct LlgTokenizer {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

impl LlgTokenizer {
    /// Our tokenizer's encoding of `text` when it spells exactly `text` in grammar tokens,
    /// otherwise the trie's greedy tokenization (never wrong, only less canonical).
    fn encode_text(&self, text: &str) -> Vec<u32> {
        let ids = self.tokenizer.encode(text, EncodeOptions::plain_text());
        let mut spelled = Vec::with_capacity(text.len());
        for &id in &ids {
            let bytes = self.trie.token(id);
            if bytes.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                return self.trie.greedy_tokenize(text.as_bytes());
            }
            spelled.extend_from_slice(bytes);
        }
        if spelled == text.as_bytes() {
            ids
        } else {
            self.trie.greedy_tokenize(text.as_bytes())
        }
    }
}

/// Forced text longer than this is tokenized canonically only at its start (see
/// [`LlgTokenizer::tokenize_bytes`]).
const CANONICAL_PREFIX: usize = 1024;

impl TokenizerEnv for LlgTokenizer {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Canonical tokens for forced text. llguidance re-tokenizes the whole forced remainder
    /// at every step; for a very long forced literal only the first ~1 KiB is tokenized by
    /// the real tokenizer (its last token dropped, as it may merge across the cut) and the
    /// rest greedily by the trie. The tokens still spell the bytes exactly, and every token
    /// that is ever forced first is canonical, since the cut moves along with the output.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        if s.len() <= 2 * CANONICAL_PREFIX {
            return self
                .trie
                .tokenize_with_greedy_fallback(s, |text| self.encode_text(text));
        }
        let mut cut = CANONICAL_PREFIX;
        while cut > 0 && s.get(cut).is_some_and(|b| b & 0xC0 == 0x80) {
            cut -= 1;
        }
        let (head, tail) = s.split_at(cut);
        let mut tokens = self
            .trie
            .tokenize_with_greedy_fallback(head, |text| self.encode_text(text));
        let mut rest = Vec::with_capacity(tail.len());
        if let Some(last) = tokens.pop() {
            rest.extend_from_slice(self.trie.token(last));
        }
        rest.extend_from_slice(tail);
        tokens.extend(self.trie.greedy_tokenize(&rest));
        tokens
    }

    fn tokenize_is_canonical(&self) -> bool {
        true
    }
}

/// A model's vocabulary prepared for constrained decoding. Build once per model with
/// [`TokenEnv::new`]; share the `Arc` between requests and threads.
pub struct TokenEnv {
    tokenizer: Arc<Tokenizer>,
    tok_env: TokEnv,
    factory: ParserFactory,
    n_logits: usize,
    eos_ids: Vec<u32>,
    /// Ids no grammar may ever allow (see the module docs).
    blocked: TokenMask,
    /// `!blocked` as words, for masking.
    allowed_words: Vec<u64>,
    /// Special (marker) token ids other than EOS, ascending.
    special_ids: Vec<u32>,
}

impl std::fmt::Debug for TokenEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenEnv")
            .field("n_logits", &self.n_logits)
            .field("vocab_size", &self.tokenizer.vocab_size())
            .field("eos_ids", &self.eos_ids)
            .field("blocked", &self.blocked.count())
            .finish()
    }
}

/// How a token id is presented to the grammar.
enum Presentation {
    Text,
    Special,
    Blocked,
}

fn presentation(tok: &Tokenizer, id: u32) -> Presentation {
    if tok.is_never_sample(id) {
        return Presentation::Blocked;
    }
    match tok.token_kind(id) {
        None | Some(TokenKind::Unused) => Presentation::Blocked,
        Some(TokenKind::Control | TokenKind::Unknown) => Presentation::Special,
        Some(TokenKind::Normal | TokenKind::Byte | TokenKind::UserDefined) => Presentation::Text,
    }
}

impl TokenEnv {
    /// The token environment for `tokenizer`, with logit rows exactly as wide as the
    /// vocabulary.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Arc<TokenEnv>, GrammarError> {
        let n = tokenizer.vocab_size();
        TokenEnv::with_logit_width(tokenizer, n)
    }

    /// The token environment for logit rows `n_logits` wide (at least the vocabulary size;
    /// ids past the vocabulary are blocked).
    pub fn with_logit_width(
        tokenizer: Arc<Tokenizer>,
        n_logits: usize,
    ) -> Result<Arc<TokenEnv>, GrammarError> {
        let vocab = tokenizer.vocab_size();
        if n_logits < vocab {
            return Err(GrammarError::Vocabulary(format!(
                "logit width {n_logits} is smaller than the vocabulary ({vocab} tokens)"
            )));
        }
        let width = u32::try_from(n_logits)
            .ok()
            .filter(|&w| w < (1 << 24))
            .ok_or_else(|| {
                GrammarError::Vocabulary(format!("logit width {n_logits} is too large"))
            })?;
        let eos_ids: Vec<u32> = if tokenizer.eos_ids().is_empty() {
            tokenizer.eos_id().into_iter().collect()
        } else {
            tokenizer.eos_ids().to_vec()
        };
        let Some(&first_eos) = eos_ids.first() else {
            return Err(GrammarError::Vocabulary(
                "the vocabulary has no end-of-generation token".to_string(),
            ));
        };

        let mut blocked = TokenMask::new(n_logits);
        let mut words: Vec<Vec<u8>> = Vec::with_capacity(n_logits);
        // bytes -> (id, rank): on duplicates the better-ranked token keeps the bytes.
        let mut owner: HashMap<Vec<u8>, u32> = HashMap::with_capacity(vocab);
        let block = |blocked: &mut TokenMask, id: u32| {
            blocked
                .set(id, true)
                .map_err(|e| GrammarError::Vocabulary(e.to_string()))
        };
        for id in 0..width {
            let bytes: Vec<u8> = match presentation(&tokenizer, id) {
                Presentation::Blocked => Vec::new(),
                Presentation::Text => tokenizer.token_bytes(id).unwrap_or_default().to_vec(),
                Presentation::Special => {
                    let text = tokenizer.token_bytes(id).unwrap_or_default();
                    if text.is_empty() {
                        Vec::new()
                    } else {
                        let mut b = Vec::with_capacity(text.len() + 1);
                        b.push(TokTrie::SPECIAL_TOKEN_MARKER);
                        b.extend_from_slice(text);
                        b
                    }
                }
            };
            if bytes.is_empty() {
                if !eos_ids.contains(&id) {
                    block(&mut blocked, id)?;
                }
                words.push(bytes);
                continue;
            }
            match owner.get(&bytes).copied() {
                None => {
                    owner.insert(bytes.clone(), id);
                    words.push(bytes);
                }
                Some(prev) => {
                    // Two ids spell the same bytes (SentencePiece `<0x20>` and `▁`): the
                    // grammar can only produce one. Keep the non-byte-fallback one, else the
                    // lower id; the other is blocked so masks and `accepts` agree.
                    let prev_is_byte = tokenizer.token_kind(prev) == Some(TokenKind::Byte);
                    let this_is_byte = tokenizer.token_kind(id) == Some(TokenKind::Byte);
                    if prev_is_byte && !this_is_byte && !eos_ids.contains(&prev) {
                        if let Some(w) = words.get_mut(prev as usize) {
                            w.clear();
                        }
                        block(&mut blocked, prev)?;
                        owner.insert(bytes.clone(), id);
                        words.push(bytes);
                    } else if !eos_ids.contains(&id) {
                        block(&mut blocked, id)?;
                        words.push(Vec::new());
                    } else {
                        words.push(bytes);
                    }
                }
            }
        }
        drop(owner);

        let info = TokRxInfo {
            vocab_size: width,
            tok_eos: first_eos,
            tok_bos: tokenizer.bos_id(),
            tok_pad: tokenizer.pad_id(),
            tok_unk: tokenizer.unk_id(),
            tok_end_of_turn: None,
        };
        let trie = catch_unwind(AssertUnwindSafe(|| {
            TokTrie::from(&info, &words).with_eos_tokens(&eos_ids)
        }))
        .map_err(|_| GrammarError::Vocabulary("the token trie could not be built".to_string()))?;
        let tok_env: TokEnv = Arc::new(LlgTokenizer {
            tokenizer: tokenizer.clone(),
            trie,
        });
        let mut factory = catch_unwind(AssertUnwindSafe(|| ParserFactory::new_simple(&tok_env)))
            .map_err(|_| GrammarError::Vocabulary("parser factory panicked".to_string()))?
            .map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();

        let allowed_words = blocked.words().iter().map(|w| !w).collect();
        let trie = tok_env.tok_trie();
        let special_ids = (0..width)
            .filter(|&t| trie.is_special_token(t) && !eos_ids.contains(&t))
            .collect();
        Ok(Arc::new(TokenEnv {
            tokenizer,
            tok_env,
            factory,
            n_logits,
            eos_ids,
            blocked,
            allowed_words,
            special_ids,
        }))
    }

    /// The tokenizer this environment was built from.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The logit width: masks have this many entries.
    pub fn n_logits(&self) -> usize {
        self.n_logits
    }

    /// End-of-generation ids, allowed where a constraint accepts.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `token` ends generation.
    pub fn is_eos(&self, token: u32) -> bool {
        self.eos_ids.contains(&token)
    }

    /// Ids that no constraint ever allows: padding/unused and never-sample entries, ids
    /// past the vocabulary, and byte-duplicates of another token.
    pub fn blocked(&self) -> &TokenMask {
        &self.blocked
    }

    /// Whether `token` is a special (marker) token in the grammar's view: only a Lark rule
    /// naming it (`<|im_end|>`, `<[id]>`) or end-of-generation can allow it.
    pub fn is_special(&self, token: u32) -> bool {
        self.tok_env.tok_trie().is_special_token(token)
    }

    /// The id of the special token whose text is `name` (such as `<think>`), if the
    /// vocabulary has one.
    pub fn special_token(&self, name: &str) -> Option<u32> {
        self.tok_env.tok_trie().get_special_token(name)
    }

    /// The bytes a grammar sees for `token`: text bytes, `0xFF` + text for specials, empty
    /// for blocked ids.
    pub fn grammar_bytes(&self, token: u32) -> &[u8] {
        self.tok_env.tok_trie().token(token)
    }

    pub(crate) fn factory(&self) -> &ParserFactory {
        &self.factory
    }

    pub(crate) fn allowed_words(&self) -> &[u64] {
        &self.allowed_words
    }

    /// Special token ids other than end-of-generation, ascending.
    pub(crate) fn special_ids(&self) -> &[u32] {
        &self.special_ids
    }
}
