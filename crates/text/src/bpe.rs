//! Byte-level BPE (GPT-2 style): words from the pre-tokenizer are spelled as byte tokens
//! and merged pair by pair, lowest merge rank first and leftmost first among equal ranks,
//! exactly as llama.cpp's `llm_tokenizer_bpe_session`.
//!
//! Merges work on token ids. A merge whose parts or result are not (textual) vocabulary
//! entries gets a *virtual* id past the vocabulary; a virtual piece left at the end of a
//! word is emitted as its two parts, recursively, so no text is lost and no control token
//! can ever come out of merging plain text.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::pretokenize::PreTokenizer;
use crate::unicode::{BYTE_TO_CHAR, byte_encode_into};
use crate::vocab::Vocab;

const NONE: u32 = u32::MAX;

/// A byte-level BPE model.
#[derive(Debug)]
pub(crate) struct Bpe {
    pub(crate) pre: PreTokenizer,
    /// llama.cpp's `ignore_merges`: a whole word that is a token is taken as is.
    ignore_merges: bool,
    /// `(left << 32 | right)` → `(rank, result)`.
    merges: HashMap<u64, (u32, u32)>,
    /// The token for each byte.
    byte_tokens: [u32; 256],
    /// Bytes without a token, ascending.
    pub(crate) missing_bytes: Vec<u8>,
    /// Parts of virtual pieces (id `n_vocab + i`), when they are a merge result.
    virtual_parts: Vec<Option<(u32, u32)>>,
    n_vocab: u32,
}

/// Reusable buffers for one `encode` call.
#[derive(Default)]
pub(crate) struct BpeScratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<(Reverse<u64>, u32, u32, u32)>,
    encoded: String,
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
    alive: bool,
}

impl Bpe {
    pub(crate) fn new(
        vocab: &Vocab,
        merges: &[String],
        pre: PreTokenizer,
        ignore_merges: bool,
    ) -> Bpe {
        let n_vocab = vocab.len() as u32;
        let mut virtuals = Virtuals {
            n_vocab,
            ids: HashMap::new(),
            parts: Vec::new(),
        };

        // A byte without a token (SmolLM2 lacks 0x04, 0x06, ...) becomes a virtual piece
        // without parts, which emits nothing: llama.cpp drops such bytes too.
        let mut byte_tokens = [0u32; 256];
        let mut missing_bytes = Vec::new();
        let mut buf = [0u8; 4];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let text = BYTE_TO_CHAR[b].encode_utf8(&mut buf);
            *slot = virtuals.resolve(vocab, text);
            if *slot >= n_vocab {
                missing_bytes.push(b as u8);
            }
        }

        let mut table: HashMap<u64, (u32, u32)> = HashMap::with_capacity(merges.len());
        let mut joined = String::new();
        let mut result_offset = 0u32;
        for (rank, m) in merges.iter().enumerate() {
            // Split at the first space after the first byte (llama.cpp: `find(' ', 1)`).
            let Some(p) = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (Some(left), Some(right)) = (m.get(..p), m.get(p + 1..)) else {
                continue;
            };
            let (l, r) = (
                virtuals.resolve(vocab, left),
                virtuals.resolve(vocab, right),
            );
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            // Vocabularies list merge results in rank order (id = rank + a constant), so
            // the previous merge's offset is a good guess for this one.
            let guess = (rank as u32).wrapping_add(result_offset);
            let result = match vocab.text_piece_id_guess(&joined, guess) {
                Some(id) => id,
                None => virtuals.resolve(vocab, &joined),
            };
            result_offset = result.wrapping_sub(rank as u32);
            if let Some(slot) = result
                .checked_sub(n_vocab)
                .and_then(|i| virtuals.parts.get_mut(i as usize))
            {
                slot.get_or_insert((l, r));
            }
            table
                .entry(u64::from(l) << 32 | u64::from(r))
                .or_insert((rank as u32, result));
        }
        Bpe {
            pre,
            ignore_merges,
            merges: table,
            byte_tokens,
            missing_bytes,
            virtual_parts: virtuals.parts,
            n_vocab,
        }
    }

    /// Appends the tokens of one pre-tokenized word.
    pub(crate) fn encode_word(
        &self,
        vocab: &Vocab,
        word: &[u8],
        out: &mut Vec<u32>,
        s: &mut BpeScratch,
    ) {
        if word.is_empty() {
            return;
        }
        if self.ignore_merges {
            s.encoded.clear();
            byte_encode_into(word, &mut s.encoded);
            if let Some(id) = vocab.text_piece_id(&s.encoded) {
                out.push(id);
                return;
            }
        }
        s.symbols.clear();
        s.heap.clear();
        let n = word.len() as u32;
        for (i, &b) in word.iter().enumerate() {
            let i = i as u32;
            s.symbols.push(Symbol {
                id: self.byte_tokens[b as usize],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                alive: true,
            });
        }
        for i in 1..n {
            self.push_pair(s, i - 1, i);
        }
        while let Some((Reverse(key), left_id, right_id, right)) = s.heap.pop() {
            let left = (key & 0xFFFF_FFFF) as u32;
            let (Some(&l), Some(&r)) =
                (s.symbols.get(left as usize), s.symbols.get(right as usize))
            else {
                continue;
            };
            if !l.alive || !r.alive || l.next != right || l.id != left_id || r.id != right_id {
                continue; // stale: one side changed since the pair was queued
            }
            let Some(&(_, result)) = self.merges.get(&pair_key(left_id, right_id)) else {
                continue;
            };
            if let Some(sym) = s.symbols.get_mut(left as usize) {
                sym.id = result;
                sym.next = r.next;
            }
            if let Some(sym) = s.symbols.get_mut(right as usize) {
                sym.alive = false;
            }
            if let Some(sym) = s.symbols.get_mut(r.next as usize) {
                sym.prev = left;
            }
            if l.prev != NONE {
                self.push_pair(s, l.prev, left);
            }
            if r.next != NONE {
                self.push_pair(s, left, r.next);
            }
        }
        let mut i = 0u32;
        while let Some(sym) = s.symbols.get(i as usize) {
            self.emit(sym.id, out);
            i = sym.next;
        }
    }

    fn push_pair(&self, s: &mut BpeScratch, left: u32, right: u32) {
        let (Some(l), Some(r)) = (s.symbols.get(left as usize), s.symbols.get(right as usize))
        else {
            return;
        };
        if let Some(&(rank, _)) = self.merges.get(&pair_key(l.id, r.id)) {
            s.heap.push((
                Reverse(u64::from(rank) << 32 | u64::from(left)),
                l.id,
                r.id,
                right,
            ));
        }
    }

    /// Emits a piece: a vocabulary id as is, a virtual one as its parts.
    fn emit(&self, id: u32, out: &mut Vec<u32>) {
        if id < self.n_vocab {
            out.push(id);
            return;
        }
        let mut stack = vec![id];
        while let Some(id) = stack.pop() {
            if id < self.n_vocab {
                out.push(id);
            } else if let Some(Some((a, b))) = self.virtual_parts.get((id - self.n_vocab) as usize)
            {
                stack.push(*b);
                stack.push(*a);
            }
        }
    }
}

/// Pieces that merges name but the vocabulary lacks (or has only as special tokens).
struct Virtuals {
    n_vocab: u32,
    ids: HashMap<String, u32>,
    parts: Vec<Option<(u32, u32)>>,
}

impl Virtuals {
    /// The id merging uses for a piece text: its vocabulary id when it is a text token,
    /// else a virtual id past the vocabulary.
    fn resolve(&mut self, vocab: &Vocab, text: &str) -> u32 {
        if let Some(id) = vocab.text_piece_id(text) {
            return id;
        }
        if let Some(&id) = self.ids.get(text) {
            return id;
        }
        let id = self.n_vocab.saturating_add(self.parts.len() as u32);
        self.parts.push(None);
        self.ids.insert(text.to_string(), id);
        id
    }
}

fn pair_key(left: u32, right: u32) -> u64 {
    u64::from(left) << 32 | u64::from(right)
}
