//! `TokenMask`: a fixed-length bitset over token ids (grammar masks, never-sample sets).

use thiserror::Error;

/// Errors of [`TokenMask`] operations.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MaskError {
    /// A token id at or beyond the mask length.
    #[error("token id {token} is outside the mask of {len} tokens")]
    OutOfRange {
        /// The offending token id.
        token: u32,
        /// The mask length in tokens.
        len: usize,
    },
    /// `from_words` got the wrong number of words for the length.
    #[error("a mask of {len} tokens needs {expected} words, got {got}")]
    WordCount {
        /// The mask length in tokens.
        len: usize,
        /// `ceil(len / 64)`.
        expected: usize,
        /// Words supplied.
        got: usize,
    },
}

/// A set of token ids `0..len`, one bit per token in little-endian `u64` words
/// (token `t` is bit `t % 64` of word `t / 64`). Bits at and beyond `len` are always zero.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TokenMask {
    len: usize,
    words: Vec<u64>,
}

impl TokenMask {
    /// An empty set over `len` tokens.
    pub fn new(len: usize) -> Self {
        TokenMask {
            len,
            words: vec![0; len.div_ceil(64)],
        }
    }

    /// The set of all `len` tokens.
    pub fn allow_all(len: usize) -> Self {
        let mut mask = TokenMask {
            len,
            words: vec![u64::MAX; len.div_ceil(64)],
        };
        mask.clear_tail();
        mask
    }

    /// A mask from raw words (`ceil(len / 64)` of them); bits beyond `len` are cleared.
    pub fn from_words(len: usize, words: Vec<u64>) -> Result<Self, MaskError> {
        let expected = len.div_ceil(64);
        if words.len() != expected {
            return Err(MaskError::WordCount {
                len,
                expected,
                got: words.len(),
            });
        }
        let mut mask = TokenMask { len, words };
        mask.clear_tail();
        Ok(mask)
    }

    /// A mask holding exactly `tokens`.
    pub fn from_tokens(len: usize, tokens: &[u32]) -> Result<Self, MaskError> {
        let mut mask = TokenMask::new(len);
        for &t in tokens {
            mask.set(t, true)?;
        }
        Ok(mask)
    }

    /// Makes the mask a set over `len` tokens whose word `i` is `word(i)`, for `i` in
    /// `0..ceil(len / 64)`, reusing the allocation (bits beyond `len` are cleared). The
    /// way to refill a mask every token without allocating.
    pub fn fill_words(&mut self, len: usize, mut word: impl FnMut(usize) -> u64) {
        self.len = len;
        self.words.clear();
        self.words.extend((0..len.div_ceil(64)).map(&mut word));
        self.clear_tail();
    }

    fn clear_tail(&mut self) {
        let rem = self.len % 64;
        if rem != 0
            && let Some(last) = self.words.last_mut()
        {
            *last &= (1u64 << rem) - 1;
        }
    }

    /// The number of token ids the mask covers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mask covers no token ids at all (`len == 0`).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `token` is in the set (false beyond `len`).
    #[inline]
    pub fn get(&self, token: u32) -> bool {
        let t = token as usize;
        t < self.len && self.words[t / 64] >> (t % 64) & 1 == 1
    }

    /// Add (`true`) or remove (`false`) `token`.
    #[inline]
    pub fn set(&mut self, token: u32, value: bool) -> Result<(), MaskError> {
        let t = token as usize;
        if t >= self.len {
            return Err(MaskError::OutOfRange {
                token,
                len: self.len,
            });
        }
        let bit = 1u64 << (t % 64);
        if value {
            self.words[t / 64] |= bit;
        } else {
            self.words[t / 64] &= !bit;
        }
        Ok(())
    }

    /// The number of tokens in the set.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The tokens in the set, in increasing id order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let base = (i * 64) as u32;
            BitIter(w).map(move |b| base + b)
        })
    }

    /// The raw words (bits beyond `len` are zero).
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Word `i`, zero beyond the end.
    #[inline]
    pub(crate) fn word_or_zero(&self, i: usize) -> u64 {
        self.words.get(i).copied().unwrap_or(0)
    }

    /// Make the mask an empty set over `len` tokens, reusing the allocation.
    pub(crate) fn reset(&mut self, len: usize) {
        self.len = len;
        self.words.clear();
        self.words.resize(len.div_ceil(64), 0);
    }

    pub(crate) fn words_mut(&mut self) -> &mut [u64] {
        &mut self.words
    }
}

/// Iterates the set bit indices of one word, lowest first.
pub(crate) struct BitIter(pub(crate) u64);

impl Iterator for BitIter {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            None
        } else {
            let b = self.0.trailing_zeros();
            self.0 &= self.0 - 1;
            Some(b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_all_covers_exactly_len_tokens() {
        for len in [0usize, 1, 63, 64, 65, 130, 151_936] {
            let m = TokenMask::allow_all(len);
            assert_eq!(m.count(), len);
            assert_eq!(m.iter().count(), len);
            assert!(!m.get(len as u32));
            if len > 0 {
                assert!(m.get(len as u32 - 1));
            }
        }
    }

    #[test]
    fn set_get_iter_roundtrip_and_out_of_range_is_an_error() {
        let mut m = TokenMask::new(130);
        for t in [0u32, 5, 63, 64, 129] {
            m.set(t, true).unwrap();
        }
        assert_eq!(m.iter().collect::<Vec<_>>(), vec![0, 5, 63, 64, 129]);
        assert_eq!(m.count(), 5);
        m.set(5, false).unwrap();
        assert!(!m.get(5));
        assert_eq!(
            m.set(130, true),
            Err(MaskError::OutOfRange {
                token: 130,
                len: 130
            })
        );
        assert!(!m.get(u32::MAX));
    }

    #[test]
    fn fill_words_reuses_the_allocation_and_clears_the_tail() {
        let mut m = TokenMask::allow_all(200);
        let before = m.words().as_ptr();
        m.fill_words(70, |i| if i == 0 { 0b1010 } else { u64::MAX });
        assert_eq!(m.len(), 70);
        assert_eq!(m.words().as_ptr(), before);
        assert_eq!(m.iter().take(2).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(m.count(), 2 + 6);
        assert!(!m.get(70));
    }

    #[test]
    fn from_words_clears_bits_beyond_len_and_checks_word_count() {
        let m = TokenMask::from_words(70, vec![u64::MAX, u64::MAX]).unwrap();
        assert_eq!(m.count(), 70);
        assert!(TokenMask::from_words(70, vec![0]).is_err());
    }
}
