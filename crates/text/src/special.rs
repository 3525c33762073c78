//! Splitting text at special-token texts before tokenizing the pieces in between.
//!
//! Same result as llama.cpp's `tokenizer_st_partition`: the candidate tokens are taken
//! longest text first (ties: lower id first); each one splits every remaining text
//! fragment at all its non-overlapping occurrences, leftmost first. Control and unknown
//! tokens take part only when special parsing is on; user-defined tokens always do.
//!
//! A byte trie over all special texts finds every occurrence in one pass; see
//! [`SpecialTokens::partition`] for why claiming them in order gives the same result.

use std::collections::BTreeMap;

use crate::vocab::{TokenKind, Vocab};

/// A piece of the partitioned text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// Raw text, a byte range of the input.
    Text(usize, usize),
    /// A special token.
    Token(u32),
}

#[derive(Debug, Default)]
struct TrieNode {
    /// Sorted by byte.
    children: Vec<(u8, u32)>,
    token: Option<u32>,
}

/// The special tokens of a vocabulary and a trie over their texts.
#[derive(Debug)]
pub(crate) struct SpecialTokens {
    nodes: Vec<TrieNode>,
    /// Rank of each special token in the matching order, by id.
    order: Vec<(u32, u32)>,
}

impl SpecialTokens {
    pub(crate) fn new(vocab: &Vocab) -> SpecialTokens {
        let mut ids: Vec<u32> = (0..vocab.len() as u32)
            .filter(|&id| {
                matches!(
                    vocab.kind(id),
                    Some(TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown)
                )
            })
            .collect();
        let text_len = |id: u32| vocab.text(id).map_or(0, str::len);
        ids.sort_by_key(|&id| (std::cmp::Reverse(text_len(id)), id));
        let mut nodes = vec![TrieNode::default()];
        let mut order = Vec::with_capacity(ids.len());
        for (rank, &id) in ids.iter().enumerate() {
            order.push((id, rank as u32));
            let Some(text) = vocab.text(id) else {
                continue;
            };
            let mut node = 0usize;
            for &b in text.as_bytes() {
                let next = match nodes[node].children.binary_search_by_key(&b, |&(k, _)| k) {
                    Ok(i) => nodes[node].children[i].1 as usize,
                    Err(i) => {
                        let new = nodes.len();
                        nodes.push(TrieNode::default());
                        nodes[node].children.insert(i, (b, new as u32));
                        new
                    }
                };
                node = next;
            }
            nodes[node].token = Some(id);
        }
        order.sort_unstable();
        SpecialTokens { nodes, order }
    }

    fn rank(&self, id: u32) -> u32 {
        self.order
            .binary_search_by_key(&id, |&(i, _)| i)
            .map_or(u32::MAX, |i| self.order[i].1)
    }

    /// Splits `text` into raw fragments and special tokens.
    ///
    /// Equivalent to llama.cpp's loop (tested against a literal copy of it) but linear in
    /// the number of occurrences: every occurrence of every special text is found with the
    /// trie, then occurrences are claimed in matching order (token rank, then position)
    /// unless they overlap one claimed before. That is exactly "each token, longest first,
    /// splits each remaining fragment at its leftmost non-overlapping occurrences".
    pub(crate) fn partition(
        &self,
        vocab: &Vocab,
        text: &str,
        parse_special: bool,
    ) -> Vec<Fragment> {
        let mut occurrences = self.occurrences(vocab, text.as_bytes(), parse_special);
        occurrences.sort_unstable();
        // Claimed spans: start → (end, id); disjoint.
        let mut claimed: BTreeMap<usize, (usize, u32)> = BTreeMap::new();
        for (_, start, id) in occurrences {
            let end = start + vocab.text(id).map_or(0, str::len);
            let overlaps = claimed
                .range(..end)
                .next_back()
                .is_some_and(|(_, &(e, _))| e > start);
            if !overlaps {
                claimed.insert(start, (end, id));
            }
        }
        let mut frags = Vec::with_capacity(2 * claimed.len() + 1);
        let mut cur = 0;
        for (start, (end, id)) in claimed {
            if start > cur {
                frags.push(Fragment::Text(cur, start));
            }
            frags.push(Fragment::Token(id));
            cur = end;
        }
        if cur < text.len() {
            frags.push(Fragment::Text(cur, text.len()));
        }
        frags
    }

    /// Every occurrence of an eligible special text: `(rank, byte position, id)`.
    fn occurrences(
        &self,
        vocab: &Vocab,
        text: &[u8],
        parse_special: bool,
    ) -> Vec<(u32, usize, u32)> {
        let mut found = Vec::new();
        for start in 0..text.len() {
            let mut node = 0usize;
            for &b in &text[start..] {
                let Some(n) = self.nodes.get(node) else { break };
                let Ok(i) = n.children.binary_search_by_key(&b, |&(k, _)| k) else {
                    break;
                };
                node = n.children[i].1 as usize;
                if let Some(id) = self.nodes.get(node).and_then(|n| n.token)
                    && (parse_special || vocab.kind(id) == Some(TokenKind::UserDefined))
                {
                    found.push((self.rank(id), start, id));
                }
            }
        }
        found
    }

    /// llama.cpp's `tokenizer_st_partition` as written, for testing [`Self::partition`].
    #[cfg(test)]
    fn partition_reference(&self, vocab: &Vocab, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(0, text.len()));
        let mut candidates: Vec<u32> = self.order.iter().map(|&(id, _)| id).collect();
        candidates.sort_by_key(|&id| self.rank(id));
        let mut next = Vec::new();
        for id in candidates {
            if !parse_special && vocab.kind(id) != Some(TokenKind::UserDefined) {
                continue;
            }
            let Some(needle) = vocab.text(id) else {
                continue;
            };
            next.clear();
            for &f in &frags {
                let Fragment::Text(start, end) = f else {
                    next.push(f);
                    continue;
                };
                let mut cur = start;
                while let Some(p) = text.get(cur..end).and_then(|h| h.find(needle)) {
                    if p > 0 {
                        next.push(Fragment::Text(cur, cur + p));
                    }
                    next.push(Fragment::Token(id));
                    cur += p + needle.len();
                }
                if cur < end {
                    next.push(Fragment::Text(cur, end));
                }
            }
            std::mem::swap(&mut frags, &mut next);
        }
        frags
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::VocabSpec;
    use proptest::prelude::*;

    const SPECIALS: &[(&str, i32)] = &[
        ("<a>", 3),
        ("<a><b>", 3),
        ("<b>", 4),
        ("\n", 4),
        ("\n\n", 4),
        ("\n\n\n", 4),
        ("aa", 3),
        ("aaa", 4),
        ("ab", 3),
        ("ba", 4),
        ("<|im_start|>", 3),
        ("<", 2),
    ];

    fn vocab() -> Vocab {
        let mut tokens: Vec<String> = ["a", "b", "x"].map(String::from).to_vec();
        let mut types = vec![1, 1, 1];
        for &(t, k) in SPECIALS {
            tokens.push(t.to_string());
            types.push(k);
        }
        Vocab::new(&VocabSpec {
            model: "gpt2",
            tokens: &tokens,
            token_types: &types,
            ..VocabSpec::default()
        })
        .expect("vocab")
    }

    proptest! {
        #[test]
        fn partition_equals_llama_cpp_loop(
            parts in prop::collection::vec(prop::sample::select(
                &["a", "b", "x", "<", ">", "<a>", "<b>", "\n", "<|im_start|>", "é"][..]), 0..30),
            parse_special in any::<bool>(),
        ) {
            let v = vocab();
            let s = SpecialTokens::new(&v);
            let text = parts.concat();
            prop_assert_eq!(
                s.partition(&v, &text, parse_special),
                s.partition_reference(&v, &text, parse_special)
            );
        }
    }
}
