//! The prefix index: full, committed KV blocks keyed by the hash of their tokens chained
//! with the hash of everything before them, so a repeated prefix (a system prompt, a
//! continued conversation) is forked instead of recomputed.
//!
//! Each entry keeps a *holder* — a backend sequence forked from the publisher and cut to
//! the end of the block — so the block (and its ancestors) stay alive after the publisher
//! ends. `users` counts the live sequences sharing the entry; an entry with no users and
//! no cached children is evictable, least recently used first.

use crate::api::KvSlot;
use sha2::{Digest, Sha256};
use std::collections::HashMap;

/// The chained hash of one block: SHA-256 of the parent's hash (none for block 0) and the
/// block's token ids (little-endian u32).
pub type BlockHash = [u8; 32];

/// The hash of a block of `tokens` following the block hashed `parent`.
pub fn chain_hash(parent: Option<&BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    match parent {
        Some(p) => {
            h.update([1u8]);
            h.update(p);
        }
        None => h.update([0u8]),
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

#[derive(Debug)]
struct Entry {
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    holder: KvSlot,
    users: usize,
    children: usize,
    last_used: u64,
}

/// What a lookup found: the longest chain of cached blocks that starts the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PrefixMatch {
    /// Blocks matched (positions `0..blocks * block_size`).
    pub blocks: usize,
    /// Of those, blocks no live sequence uses (evictable until shared).
    pub idle: usize,
    /// The holder of the deepest matched block (fork it to share the whole chain).
    pub holder: Option<KvSlot>,
}

/// Cached blocks by chained hash.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    entries: HashMap<BlockHash, Entry>,
    tick: u64,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> PrefixIndex {
        PrefixIndex::default()
    }

    /// Blocks cached.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.entries.contains_key(hash)
    }

    /// Entries no live sequence uses (each frees at least one block once evicted).
    pub fn idle_count(&self) -> usize {
        self.entries.values().filter(|e| e.users == 0).count()
    }

    /// The longest cached chain starting the sequence whose full blocks hash to `hashes`
    /// and whose tokens are `tokens` (compared too, so a hash collision cannot alias).
    pub fn lookup(&self, hashes: &[BlockHash], tokens: &[u32], block_size: usize) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        let mut parent: Option<&BlockHash> = None;
        for (d, h) in hashes.iter().enumerate() {
            let Some(e) = self.entries.get(h) else { break };
            let block = tokens.get(d * block_size..(d + 1) * block_size);
            if e.parent.as_ref() != parent || block != Some(e.tokens.as_slice()) {
                break;
            }
            m.blocks = d + 1;
            m.idle += usize::from(e.users == 0);
            m.holder = Some(e.holder);
            parent = Some(h);
        }
        m
    }

    /// A live sequence starts sharing these entries.
    pub fn acquire(&mut self, hashes: &[BlockHash]) {
        self.tick += 1;
        for h in hashes {
            if let Some(e) = self.entries.get_mut(h) {
                e.users += 1;
                e.last_used = self.tick;
            }
        }
    }

    /// A live sequence stops sharing these entries (it ended, or was preempted).
    pub fn release(&mut self, hashes: &[BlockHash]) {
        self.tick += 1;
        for h in hashes {
            if let Some(e) = self.entries.get_mut(h) {
                e.users = e.users.saturating_sub(1);
                e.last_used = self.tick;
            }
        }
    }

    /// Publishes a block (the publisher counts as its first user). Does nothing when
    /// `hash` is already cached (the caller then releases `holder`; returns false).
    pub fn publish(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        holder: KvSlot,
    ) -> bool {
        if self.entries.contains_key(&hash) {
            return false;
        }
        self.tick += 1;
        if let Some(p) = parent.as_ref().and_then(|p| self.entries.get_mut(p)) {
            p.children += 1;
        }
        self.entries.insert(
            hash,
            Entry {
                parent,
                tokens: tokens.to_vec(),
                holder,
                users: 1,
                children: 0,
                last_used: self.tick,
            },
        );
        true
    }

    /// Removes the least recently used entry with no users and no cached children and
    /// returns its holder (to be released); `None` when nothing is evictable.
    pub fn evict_one(&mut self) -> Option<KvSlot> {
        let (&hash, _) = self
            .entries
            .iter()
            .filter(|(_, e)| e.users == 0 && e.children == 0)
            .min_by_key(|(h, e)| (e.last_used, **h))?;
        let e = self.entries.remove(&hash)?;
        if let Some(p) = e.parent.as_ref().and_then(|p| self.entries.get_mut(p)) {
            p.children = p.children.saturating_sub(1);
        }
        Some(e.holder)
    }

    /// Empties the index; returns every holder (to be released).
    pub fn drain(&mut self) -> Vec<KvSlot> {
        self.entries.drain().map(|(_, e)| e.holder).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(tokens: &[u32], bs: usize) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = Vec::new();
        for block in tokens.chunks_exact(bs) {
            let h = chain_hash(out.last(), block);
            out.push(h);
        }
        out
    }

    #[test]
    fn chained_hash_depends_on_everything_before() {
        let a = hashes(&[1, 2, 3, 4, 5, 6], 3);
        let b = hashes(&[9, 2, 3, 4, 5, 6], 3);
        assert_ne!(a[1], b[1], "same block tokens after a different prefix");
        assert_eq!(a, hashes(&[1, 2, 3, 4, 5, 6], 3));
    }

    #[test]
    fn lookup_finds_the_longest_published_chain() {
        let toks = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let h = hashes(&toks, 3);
        let mut ix = PrefixIndex::new();
        assert!(ix.publish(h[0], None, &toks[0..3], KvSlot(10)));
        assert!(ix.publish(h[1], Some(h[0]), &toks[3..6], KvSlot(11)));
        let m = ix.lookup(&h, &toks, 3);
        assert_eq!((m.blocks, m.idle, m.holder), (2, 0, Some(KvSlot(11))));
        ix.release(&h[..2]);
        assert_eq!(ix.lookup(&h, &toks, 3).idle, 2);
        // A different continuation matches only the shared first block.
        let other = [1, 2, 3, 0, 0, 0];
        let m = ix.lookup(&hashes(&other, 3), &other, 3);
        assert_eq!((m.blocks, m.holder), (1, Some(KvSlot(10))));
    }

    #[test]
    fn eviction_is_lru_leaves_first_and_never_touches_used_entries() {
        let toks = [1, 2, 3, 4, 5, 6];
        let h = hashes(&toks, 3);
        let other = [7, 7, 7];
        let ho = hashes(&other, 3);
        let mut ix = PrefixIndex::new();
        ix.publish(h[0], None, &toks[0..3], KvSlot(0));
        ix.publish(h[1], Some(h[0]), &toks[3..6], KvSlot(1));
        ix.publish(ho[0], None, &other, KvSlot(2));
        assert_eq!(ix.evict_one(), None, "all in use");
        ix.release(&h); // chain idle, older than `other`'s release
        ix.release(&ho);
        assert_eq!(ix.idle_count(), 3);
        // The parent has a child: the leaf goes first, then the parent, then the newest.
        assert_eq!(ix.evict_one(), Some(KvSlot(1)));
        assert_eq!(ix.evict_one(), Some(KvSlot(0)));
        assert_eq!(ix.evict_one(), Some(KvSlot(2)));
        assert!(ix.is_empty());
    }

    #[test]
    fn publishing_twice_keeps_the_first_holder() {
        let toks = [4, 4];
        let h = hashes(&toks, 2);
        let mut ix = PrefixIndex::new();
        assert!(ix.publish(h[0], None, &toks, KvSlot(3)));
        assert!(!ix.publish(h[0], None, &toks, KvSlot(4)));
        assert_eq!(ix.drain(), vec![KvSlot(3)]);
    }
}
