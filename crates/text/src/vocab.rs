//! The plain-data description of a vocabulary, and the token table built from it.

use std::hash::{BuildHasher, RandomState};

use crate::error::TextError;

/// What a vocabulary entry is, from `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenKind {
    /// Type 1: ordinary text.
    Normal,
    /// Type 2: the unknown token (`<unk>`).
    Unknown,
    /// Type 3: a control token (BOS, EOS, chat markers). Matched in text only when the
    /// caller asks for special-token parsing; never produced from plain text.
    Control,
    /// Type 4: a user-defined token. Always matched in text (as llama.cpp and HF do) and
    /// decoded as its literal text, so it behaves as text, not as a marker.
    UserDefined,
    /// Type 5 (and any unknown type value): an unused or padding entry. Never sampled.
    Unused,
    /// Type 6: a byte-fallback token `<0xNN>`.
    Byte,
}

impl TokenKind {
    /// The kind for a `tokenizer.ggml.token_type` value. Values outside 1–6 (llama.cpp's
    /// "undefined") are treated as [`TokenKind::Unused`].
    pub fn from_gguf_type(t: i32) -> TokenKind {
        match t {
            1 => TokenKind::Normal,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            6 => TokenKind::Byte,
            _ => TokenKind::Unused,
        }
    }

    /// Control, unknown and unused entries: markers rather than text.
    pub fn is_special(self) -> bool {
        matches!(
            self,
            TokenKind::Control | TokenKind::Unknown | TokenKind::Unused
        )
    }
}

/// A vocabulary as GGUF describes it, borrowed from wherever it was read.
///
/// [`crate::Tokenizer::from_gguf`] fills this from `tokenizer.ggml.*` metadata; tests and
/// tools can fill it directly. `None` flags take the defaults llama.cpp uses for the model
/// type (SentencePiece: `add_bos` and `add_space_prefix` true; BPE: both false except
/// that llama3-style pre-tokenizers add BOS).
#[derive(Debug, Clone, Default)]
pub struct VocabSpec<'a> {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: &'a str,
    /// `tokenizer.ggml.pre`: the pre-tokenizer name (BPE only; ignored for SentencePiece).
    pub pre: &'a str,
    /// `tokenizer.ggml.tokens`.
    pub tokens: &'a [String],
    /// `tokenizer.ggml.token_type`; empty means every token is normal.
    pub token_types: &'a [i32],
    /// `tokenizer.ggml.scores` (SentencePiece merge priorities); `None` means all zero.
    pub scores: Option<&'a [f32]>,
    /// `tokenizer.ggml.merges` (BPE), `"left right"` in rank order.
    pub merges: &'a [String],
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`.
    pub eot_id: Option<u32>,
    /// `tokenizer.ggml.eom_token_id`.
    pub eom_id: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix`.
    pub add_space_prefix: Option<bool>,
}

/// The token table: texts, kinds, scores and the text → id map.
///
/// Texts live in one buffer and the map is an open-addressing table of ids (no allocation
/// per token: a 262k-token vocabulary loads in a few tens of milliseconds). Hashing is
/// SipHash with a per-table random key, so crafted vocabularies cannot force collisions.
#[derive(Debug)]
pub(crate) struct Vocab {
    buf: String,
    /// `buf[offsets[id]..offsets[id + 1]]` is the text of `id`.
    offsets: Vec<usize>,
    pub(crate) kinds: Vec<TokenKind>,
    pub(crate) scores: Vec<f32>,
    /// Open addressing with linear probing; the length is a power of two.
    slots: Vec<Slot>,
    hasher: RandomState,
}

/// A map entry: the text's location is kept here so that a lookup touches one slot and
/// the text, not the offsets table.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// High 32 bits of the hash.
    hash: u32,
    /// The token id, `EMPTY` for a free slot.
    id: u32,
    start: u32,
    /// The text length, with [`TEXT_PIECE`] set for tokens plain text may be made of.
    len: u32,
}

const EMPTY: u32 = u32::MAX;
const TEXT_PIECE: u32 = 1 << 31;
/// Texts of all tokens together must stay below this many bytes.
const MAX_TEXT_BYTES: usize = 1 << 31;

impl Vocab {
    pub(crate) fn new(spec: &VocabSpec<'_>) -> Result<Vocab, TextError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(TextError::EmptyVocab);
        }
        if u32::try_from(n).map_or(true, |n| n == EMPTY) {
            return Err(TextError::VocabTooLarge(n));
        }
        if !spec.token_types.is_empty() && spec.token_types.len() != n {
            return Err(TextError::LengthMismatch {
                what: "tokenizer.ggml.token_type",
                expected: n,
                found: spec.token_types.len(),
            });
        }
        let scores = match spec.scores {
            Some(s) if s.len() != n => {
                return Err(TextError::LengthMismatch {
                    what: "tokenizer.ggml.scores",
                    expected: n,
                    found: s.len(),
                });
            }
            Some(s) => s.to_vec(),
            None => vec![0.0; n],
        };
        // Empty entries become "[EMPTY_<id>]" (at most 20 bytes).
        let total: usize = spec
            .tokens
            .iter()
            .map(|t| if t.is_empty() { 20 } else { t.len() })
            .sum();
        if total >= MAX_TEXT_BYTES {
            return Err(TextError::VocabTooLarge(n));
        }
        let mut vocab = Vocab {
            buf: String::with_capacity(total),
            offsets: Vec::with_capacity(n + 1),
            kinds: Vec::with_capacity(n),
            scores,
            slots: vec![
                Slot {
                    hash: 0,
                    id: EMPTY,
                    start: 0,
                    len: 0,
                };
                (n + n / 2).next_power_of_two()
            ],
            hasher: RandomState::new(),
        };
        vocab.offsets.push(0);
        for (i, t) in spec.tokens.iter().enumerate() {
            let id = i as u32; // n fits in u32, checked above
            // llama.cpp renames empty entries so that every token has a distinct text.
            if t.is_empty() {
                vocab.buf.push_str(&format!("[EMPTY_{i}]"));
            } else {
                vocab.buf.push_str(t);
            }
            vocab.offsets.push(vocab.buf.len());
            vocab.kinds.push(
                spec.token_types
                    .get(i)
                    .map_or(TokenKind::Normal, |&t| TokenKind::from_gguf_type(t)),
            );
            vocab.insert(id)?;
        }
        Ok(vocab)
    }

    fn hash(&self, text: &str) -> u64 {
        self.hasher.hash_one(text)
    }

    /// Adds `id` (whose text and kind are already stored) to the map.
    fn insert(&mut self, id: u32) -> Result<(), TextError> {
        let i = id as usize;
        let (Some(&a), Some(&b)) = (self.offsets.get(i), self.offsets.get(i + 1)) else {
            return Ok(());
        };
        let text = self.buf.get(a..b).unwrap_or_default();
        let h = self.hash(text);
        let piece = matches!(
            self.kind(id),
            Some(TokenKind::Normal | TokenKind::UserDefined)
        );
        // Offsets fit in u32: the buffer is smaller than MAX_TEXT_BYTES.
        let new = Slot {
            hash: (h >> 32) as u32,
            id,
            start: a as u32,
            len: (b - a) as u32 | if piece { TEXT_PIECE } else { 0 },
        };
        if let Some(other) = self.find(text, h) {
            return Err(TextError::DuplicateToken {
                text: text.to_string(),
                first: other.id,
                second: id,
            });
        }
        let mask = self.slots.len() - 1;
        let mut j = h as usize & mask;
        while self.slots[j].id != EMPTY {
            j = (j + 1) & mask;
        }
        self.slots[j] = new;
        Ok(())
    }

    /// The slot holding `text` (whose hash is `h`).
    fn find(&self, text: &str, h: u64) -> Option<Slot> {
        let mask = self.slots.len() - 1;
        let mut j = h as usize & mask;
        loop {
            let slot = *self.slots.get(j)?;
            if slot.id == EMPTY {
                return None;
            }
            if slot.hash == (h >> 32) as u32 && (slot.len & !TEXT_PIECE) as usize == text.len() {
                let start = slot.start as usize;
                if self.buf.get(start..start + text.len()) == Some(text) {
                    return Some(slot);
                }
            }
            j = (j + 1) & mask;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.kinds.len()
    }

    /// The text of token `id`.
    pub(crate) fn text(&self, id: u32) -> Option<&str> {
        let i = id as usize;
        let (a, b) = (*self.offsets.get(i)?, *self.offsets.get(i + 1)?);
        self.buf.get(a..b)
    }

    /// All token texts in id order.
    pub(crate) fn texts(&self) -> impl Iterator<Item = &str> {
        self.offsets
            .windows(2)
            .map(|w| self.buf.get(w[0]..w[1]).unwrap_or_default())
    }

    pub(crate) fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// The id of a token with exactly this text.
    pub(crate) fn id_of(&self, text: &str) -> Option<u32> {
        self.find(text, self.hash(text)).map(|s| s.id)
    }

    /// The id of a token with this text that plain text may be segmented into (not a
    /// control, unknown, unused or byte entry).
    pub(crate) fn text_piece_id(&self, text: &str) -> Option<u32> {
        self.find(text, self.hash(text))
            .filter(|s| s.len & TEXT_PIECE != 0)
            .map(|s| s.id)
    }

    /// [`Vocab::text_piece_id`] with a guess to try first (cheap when right).
    pub(crate) fn text_piece_id_guess(&self, text: &str, guess: u32) -> Option<u32> {
        if self.text(guess) == Some(text)
            && matches!(
                self.kind(guess),
                Some(TokenKind::Normal | TokenKind::UserDefined)
            )
        {
            return Some(guess);
        }
        self.text_piece_id(text)
    }
}
