//! SentencePiece-style BPE as llama.cpp's `llm_tokenizer_spm_session`: the text (spaces
//! already escaped to `▁`) starts as one symbol per character; the adjacent pair whose
//! concatenation is a vocabulary piece with the highest score merges first (leftmost among
//! equal scores), until no pair forms a piece. Symbols that are not pieces fall back to
//! `<0xNN>` byte tokens.
//!
//! Unlike llama.cpp, control, unknown, unused and byte entries are never formed by merging
//! plain text (their texts, such as `<start_of_turn>` or `<0x0A>`, stay text). With special
//! parsing on, control texts are split out before this runs, so that only changes what
//! plain-text mode produces.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::error::TextError;
use crate::vocab::Vocab;

const NONE: u32 = u32::MAX;

/// A SentencePiece model: the byte-fallback table (pieces and scores live in the vocab).
#[derive(Debug)]
pub(crate) struct Spm {
    byte_tokens: [u32; 256],
}

/// Reusable buffers for one `encode` call.
#[derive(Default)]
pub(crate) struct SpmScratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<(u32, Reverse<u32>, u32, u32)>,
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: u32,
    len: u32,
    prev: u32,
    next: u32,
}

/// Maps an `f32` to a `u32` with the same order (`-0.0` equals `0.0`, as in C++ `<`).
fn score_key(f: f32) -> u32 {
    let f = if f == 0.0 { 0.0 } else { f };
    let bits = f.to_bits();
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

impl Spm {
    pub(crate) fn new(vocab: &Vocab, unk: Option<u32>) -> Result<Spm, TextError> {
        let mut byte_tokens = [0u32; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let b = b as u8;
            let hex = format!("<0x{b:02X}>");
            let plain = if b.is_ascii() {
                vocab.id_of(char::from(b).encode_utf8(&mut [0u8; 4]))
            } else {
                None
            };
            *slot = vocab
                .id_of(&hex)
                .or(plain)
                .or(unk)
                .ok_or(TextError::MissingByteFallback(b))?;
        }
        Ok(Spm { byte_tokens })
    }

    /// Appends the tokens of `text` (a fragment with spaces already escaped).
    pub(crate) fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>, s: &mut SpmScratch) {
        s.symbols.clear();
        s.heap.clear();
        let n = text.chars().count() as u32;
        for (i, (off, c)) in text.char_indices().enumerate() {
            let i = i as u32;
            s.symbols.push(Symbol {
                start: off as u32,
                len: c.len_utf8() as u32,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
            });
        }
        for i in 1..n {
            try_add_pair(vocab, text, s, i - 1, i);
        }
        while let Some((_, Reverse(left), right, size)) = s.heap.pop() {
            let (Some(&l), Some(&r)) =
                (s.symbols.get(left as usize), s.symbols.get(right as usize))
            else {
                continue;
            };
            if l.len == 0 || r.len == 0 || l.len + r.len != size {
                continue; // stale: one side changed since the pair was queued
            }
            if let Some(sym) = s.symbols.get_mut(left as usize) {
                sym.len += r.len;
                sym.next = r.next;
            }
            if let Some(sym) = s.symbols.get_mut(right as usize) {
                sym.len = 0;
            }
            if let Some(sym) = s.symbols.get_mut(r.next as usize) {
                sym.prev = left;
            }
            if l.prev != NONE {
                try_add_pair(vocab, text, s, l.prev, left);
            }
            if r.next != NONE {
                try_add_pair(vocab, text, s, left, r.next);
            }
        }
        let mut i = 0u32;
        while let Some(sym) = s.symbols.get(i as usize) {
            let (a, b) = (sym.start as usize, (sym.start + sym.len) as usize);
            let piece = text.get(a..b).unwrap_or("");
            match vocab.text_piece_id(piece) {
                Some(id) => out.push(id),
                None => out.extend(piece.bytes().map(|b| self.byte_tokens[b as usize])),
            }
            i = sym.next;
        }
    }
}

fn try_add_pair(vocab: &Vocab, text: &str, s: &mut SpmScratch, left: u32, right: u32) {
    let (Some(l), Some(r)) = (s.symbols.get(left as usize), s.symbols.get(right as usize)) else {
        return;
    };
    let (a, b) = (l.start as usize, (r.start + r.len) as usize);
    let Some(id) = text.get(a..b).and_then(|piece| vocab.text_piece_id(piece)) else {
        return;
    };
    let score = vocab.scores.get(id as usize).copied().unwrap_or(0.0);
    s.heap
        .push((score_key(score), Reverse(left), right, l.len + r.len));
}

#[cfg(test)]
mod tests {
    use super::score_key;

    #[test]
    fn score_key_preserves_float_order() {
        let xs = [-1e9f32, -506.0, -1.0, -0.0, 0.0, 1e-9, 3.5, f32::INFINITY];
        for w in xs.windows(2) {
            assert!(score_key(w[0]) <= score_key(w[1]), "{w:?}");
        }
        assert_eq!(score_key(-0.0), score_key(0.0));
    }
}
