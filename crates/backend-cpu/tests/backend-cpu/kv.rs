//! Paged KV bookkeeping: allocation, refcounts, truncation, sliding-window release,
//! sharing with copy-on-write, and the value round trip.

use crate::common::Rng;
use lockstep_backend_cpu::{AttnRow, BlockAllocator, Error, KvCache, KvConfig, KvType};

fn config(windows: Vec<Option<usize>>, kv_type: KvType) -> KvConfig {
    KvConfig {
        n_kv_head: 2,
        head_dim: 16,
        block_size: 4,
        kv_type,
        windows,
        global_blocks: 16,
        sliding_blocks: 8,
    }
}

#[test]
fn allocator_counts_refcounts_and_reuses_blocks() {
    let mut a = BlockAllocator::new(3);
    assert_eq!(a.free_count(), 3);
    let b0 = a.alloc().unwrap();
    let b1 = a.alloc().unwrap();
    assert_eq!((b0, b1), (0, 1));
    a.retain(b0);
    assert_eq!(a.refcount(b0), 2);
    a.release(b0);
    assert_eq!(a.free_count(), 1);
    a.release(b0);
    assert_eq!(a.free_count(), 2);
    assert_eq!(a.refcount(b0), 0);
    assert!(a.alloc().is_some() && a.alloc().is_some());
    assert!(a.alloc().is_none());
}

#[test]
fn layers_are_grouped_by_window() {
    let kv = KvCache::new(config(
        vec![Some(6), None, Some(6), None, Some(9)],
        KvType::F16,
    ))
    .unwrap();
    assert_eq!(kv.n_groups(), 3);
    assert_eq!(kv.group_of(0).unwrap(), kv.group_of(2).unwrap());
    assert_eq!(kv.group_of(1).unwrap(), kv.group_of(3).unwrap());
    assert_ne!(kv.group_of(0).unwrap(), kv.group_of(4).unwrap());
    assert_eq!(kv.group_window(kv.group_of(1).unwrap()), None);
    assert_eq!(kv.group_window(kv.group_of(4).unwrap()), Some(9));
    assert!(matches!(kv.group_of(5), Err(Error::Layer { .. })));
}

#[test]
fn reserve_allocates_whole_blocks_all_or_nothing() {
    let mut kv = KvCache::new(config(vec![None, Some(6)], KvType::F16)).unwrap();
    let (g, s) = (kv.group_of(0).unwrap(), kv.group_of(1).unwrap());
    let mut seq = kv.new_sequence();
    kv.reserve(&mut seq, 5).unwrap();
    assert_eq!(seq.len(), 5);
    assert_eq!(seq.table(g).unwrap().held(), 2);
    assert_eq!(kv.allocator(g).unwrap().free_count(), 14);
    assert_eq!(kv.allocator(s).unwrap().free_count(), 6);
    // The sliding pool (8 blocks) cannot hold 40 positions: nothing changes.
    let err = kv.reserve(&mut seq, 40).unwrap_err();
    assert!(matches!(err, Error::OutOfBlocks { group, .. } if group == s));
    assert_eq!(seq.len(), 5);
    assert_eq!(kv.allocator(g).unwrap().free_count(), 14);
    kv.reserve(&mut seq, 32).unwrap();
    assert_eq!(kv.allocator(s).unwrap().free_count(), 0);
    kv.release_sequence(seq);
    assert_eq!(kv.allocator(g).unwrap().free_count(), 16);
    assert_eq!(kv.allocator(s).unwrap().free_count(), 8);
}

#[test]
fn truncate_frees_blocks_past_the_new_length_without_copying() {
    let mut kv = KvCache::new(config(vec![None], KvType::F32)).unwrap();
    let mut seq = kv.new_sequence();
    kv.reserve(&mut seq, 13).unwrap(); // 4 blocks
    let w = 2 * 16;
    let k: Vec<f32> = (0..w).map(|i| i as f32).collect();
    kv.write(0, &seq, 4, &k, &k).unwrap();
    let before = seq.table(0).unwrap().blocks().to_vec();
    kv.truncate(&mut seq, 5); // keeps blocks 0 and 1
    assert_eq!(seq.len(), 5);
    assert_eq!(seq.table(0).unwrap().blocks(), &before[..2]);
    assert_eq!(kv.allocator(0).unwrap().free_count(), 14);
    let (mut rk, mut rv) = (vec![0.0; w], vec![0.0; w]);
    kv.read(0, &seq, 4, &mut rk, &mut rv).unwrap();
    assert_eq!(rk, k);
    assert!(matches!(
        kv.write(0, &seq, 5, &k, &k),
        Err(Error::NotReserved { pos: 5, len: 5 })
    ));
    kv.truncate(&mut seq, 8); // longer than the length: no-op
    assert_eq!(seq.len(), 5);
    kv.truncate(&mut seq, 0);
    assert_eq!(kv.allocator(0).unwrap().free_count(), 16);
}

#[test]
fn sliding_groups_release_blocks_that_left_the_window() {
    // Window 6, block 4: after committing n positions, later queries see keys >= n - 5.
    let mut kv = KvCache::new(config(vec![Some(6), None], KvType::F16)).unwrap();
    let (s, g) = (kv.group_of(0).unwrap(), kv.group_of(1).unwrap());
    let mut seq = kv.new_sequence();
    kv.reserve(&mut seq, 14).unwrap(); // blocks 0..4
    kv.release_outside_window(&mut seq, 8); // first visible key 3: block 0 is still needed
    assert_eq!(seq.table(s).unwrap().held(), 4);
    kv.release_outside_window(&mut seq, 9); // first visible key 4: block 0 goes
    assert_eq!(seq.table(s).unwrap().held(), 3);
    assert!(seq.table(s).unwrap().block(0).is_none());
    assert_eq!(kv.allocator(s).unwrap().free_count(), 5);
    kv.release_outside_window(&mut seq, 14); // first visible key 9: blocks 0, 1 gone
    assert_eq!(seq.table(s).unwrap().held(), 2);
    // The global group keeps everything.
    assert_eq!(seq.table(g).unwrap().held(), 4);
    let w = 2 * 16;
    let z = vec![0.0; w];
    assert!(matches!(
        kv.write(0, &seq, 3, &z, &z),
        Err(Error::Released { pos: 3, .. })
    ));
    kv.write(0, &seq, 9, &z, &z).unwrap();
    kv.write(1, &seq, 3, &z, &z).unwrap();
    // Growing after a release keeps logical indices = position / block size.
    kv.reserve(&mut seq, 20).unwrap();
    assert_eq!(seq.table(s).unwrap().blocks().len(), 5);
    assert_eq!(seq.table(s).unwrap().held(), 3);
    // Truncation after a release frees only the tail.
    kv.truncate(&mut seq, 15);
    assert_eq!(seq.table(s).unwrap().held(), 2);
    kv.release_sequence(seq);
    assert_eq!(kv.allocator(s).unwrap().free_count(), 8);
    assert_eq!(kv.allocator(g).unwrap().free_count(), 16);
}

#[test]
fn forked_sequences_share_blocks_until_copied_on_write() {
    let mut kv = KvCache::new(config(vec![None, None], KvType::F16)).unwrap();
    let mut rng = Rng(11);
    let w = 2 * 16;
    let mut a = kv.new_sequence();
    kv.reserve(&mut a, 6).unwrap();
    let rows: Vec<Vec<f32>> = (0..6).map(|_| rng.vec(w, -1.0, 1.0)).collect();
    for layer in 0..2 {
        for (p, r) in rows.iter().enumerate() {
            kv.write(layer, &a, p, r, r).unwrap();
        }
    }
    let mut b = kv.fork(&a);
    assert_eq!(b.len(), 6);
    let blk = a.table(0).unwrap().blocks()[1];
    assert_eq!(kv.allocator(0).unwrap().refcount(blk), 2);
    // Writing into the shared, partly filled block is refused...
    let other = rng.vec(w, -1.0, 1.0);
    assert!(matches!(
        kv.write(0, &b, 5, &other, &other),
        Err(Error::SharedBlock { pos: 5, .. })
    ));
    // ...until it is copied; then both sequences read their own data.
    kv.make_writable(&mut b, 5).unwrap();
    assert_ne!(b.table(0).unwrap().blocks()[1], blk);
    assert_eq!(
        b.table(0).unwrap().blocks()[0],
        a.table(0).unwrap().blocks()[0]
    );
    kv.write(0, &b, 5, &other, &other).unwrap();
    let (mut k, mut v) = (vec![0.0; w], vec![0.0; w]);
    for layer in 0..2 {
        kv.read(layer, &b, 4, &mut k, &mut v).unwrap(); // copied data intact
        let mut want = vec![0.0; w];
        let mut wv = vec![0.0; w];
        kv.read(layer, &a, 4, &mut want, &mut wv).unwrap();
        assert_eq!(k, want);
    }
    kv.read(0, &a, 5, &mut k, &mut v).unwrap();
    let mut kb = vec![0.0; w];
    kv.read(0, &b, 5, &mut kb, &mut v).unwrap();
    assert_ne!(k, kb);
    kv.release_sequence(a);
    kv.release_sequence(b);
    assert_eq!(kv.allocator(0).unwrap().free_count(), 16);
}

#[test]
fn blocks_needed_is_what_a_prepare_takes() {
    // Cut back to `from`, reserve up to `to`, copy shared blocks at or after `from`: the
    // free count drops by exactly what `BlockAllocator::blocks_needed` said.
    let cases = [
        (6, 6, 6),
        (6, 5, 9),
        (6, 2, 3),
        (6, 8, 13),
        (6, 0, 4),
        (3, 4, 4),
    ];
    for (len, from, to) in cases {
        for shared in [false, true] {
            let mut kv = KvCache::new(config(vec![None], KvType::F16)).unwrap();
            let mut a = kv.new_sequence();
            kv.reserve(&mut a, len).unwrap();
            let mut b = if shared {
                kv.fork(&a)
            } else {
                kv.new_sequence()
            };
            if !shared {
                kv.reserve(&mut b, len).unwrap();
            }
            let alloc = kv.allocator(0).unwrap();
            let need = alloc.blocks_needed(b.table(0).unwrap().blocks(), b.len(), 4, from, to);
            let before = alloc.free_count();
            kv.truncate(&mut b, from);
            let after_cut = kv.allocator(0).unwrap().free_count();
            kv.reserve(&mut b, to).unwrap();
            kv.make_writable(&mut b, from).unwrap();
            let taken = after_cut - kv.allocator(0).unwrap().free_count();
            assert_eq!(
                need, taken,
                "len {len}, from {from}, to {to}, shared {shared} (free before {before})"
            );
        }
    }
}

#[test]
fn values_round_trip_through_f16_and_f32() {
    for kv_type in [KvType::F16, KvType::F32] {
        let mut kv = KvCache::new(config(vec![None], kv_type)).unwrap();
        let mut seq = kv.new_sequence();
        kv.reserve(&mut seq, 9).unwrap();
        let mut rng = Rng(12);
        let w = 2 * 16;
        let rows: Vec<Vec<f32>> = (0..9).map(|_| rng.vec(w, -3.0, 3.0)).collect();
        let refs: Vec<AttnRow<'_>> = (0..9).map(|p| AttnRow { seq: &seq, pos: p }).collect();
        let flat: Vec<f32> = rows.concat();
        kv.write_rows(0, &refs, &flat, &flat).unwrap();
        for (p, r) in rows.iter().enumerate() {
            let (mut k, mut v) = (vec![0.0; w], vec![0.0; w]);
            kv.read(0, &seq, p, &mut k, &mut v).unwrap();
            for i in 0..w {
                let want = match kv_type {
                    KvType::F16 => lockstep_backend_cpu::canon::f16_to_f32(
                        lockstep_backend_cpu::canon::f32_to_f16(r[i]),
                    ),
                    KvType::F32 => r[i],
                };
                assert_eq!(k[i].to_bits(), want.to_bits());
                assert_eq!(v[i].to_bits(), want.to_bits());
            }
        }
        assert!(kv.write(0, &seq, 0, &[0.0; 3], &[0.0; 32]).is_err());
    }
}

#[test]
fn bad_configurations_are_errors() {
    let mut c = config(vec![None], KvType::F16);
    c.block_size = 0;
    assert!(KvCache::new(c.clone()).is_err());
    c.block_size = 4;
    c.windows = vec![Some(0)];
    assert!(KvCache::new(c.clone()).is_err());
    c.windows = vec![None];
    c.head_dim = 0;
    assert!(KvCache::new(c).is_err());
}

#[test]
fn exported_blocks_import_into_another_cache_bit_for_bit() {
    for kv_type in [KvType::F16, KvType::F32] {
        // A global layer, a sliding layer (window 6) and another global layer.
        let windows = vec![None, Some(6), None];
        let mut src = KvCache::new(config(windows.clone(), kv_type)).unwrap();
        let mut seq = src.new_sequence();
        src.reserve(&mut seq, 8).unwrap();
        let mut rng = Rng(7);
        let w = 2 * 16;
        for layer in 0..3 {
            for p in 0..8 {
                let (k, v) = (rng.wild_vec(w), rng.wild_vec(w));
                src.write(layer, &seq, p, &k, &v).unwrap();
            }
        }
        let mut blocks = Vec::new();
        for b in 0..2 {
            let mut bytes = Vec::new();
            src.export_block(&seq, b, &mut bytes).unwrap();
            assert_eq!(bytes.len(), src.block_bytes());
            blocks.push(bytes);
        }
        let mut dst = KvCache::new(config(windows, kv_type)).unwrap();
        let mut copy = dst.new_sequence();
        dst.reserve(&mut copy, 8).unwrap();
        for (b, bytes) in blocks.iter().enumerate() {
            dst.import_block(&copy, b, bytes).unwrap();
        }
        for layer in 0..3 {
            for p in 0..8 {
                let (mut k0, mut v0, mut k1, mut v1) =
                    (vec![0.0; w], vec![0.0; w], vec![0.0; w], vec![0.0; w]);
                src.read(layer, &seq, p, &mut k0, &mut v0).unwrap();
                dst.read(layer, &copy, p, &mut k1, &mut v1).unwrap();
                crate::common::assert_same(
                    &crate::common::bits(&k1),
                    &crate::common::bits(&k0),
                    "keys",
                );
                crate::common::assert_same(
                    &crate::common::bits(&v1),
                    &crate::common::bits(&v0),
                    "values",
                );
            }
        }
        // A wrong length, a shared block and an unreserved block are refused.
        assert!(matches!(
            dst.import_block(&copy, 0, &blocks[0][1..]),
            Err(Error::Shape { .. })
        ));
        let fork = dst.fork(&copy);
        assert!(matches!(
            dst.import_block(&copy, 1, &blocks[1]),
            Err(Error::SharedBlock { .. })
        ));
        dst.release_sequence(fork);
        assert!(matches!(
            dst.import_block(&copy, 2, &blocks[1]),
            Err(Error::NotReserved { .. })
        ));
        // A block that left the sliding window cannot be exported.
        src.release_outside_window(&mut seq, 10);
        let mut bytes = Vec::new();
        assert!(matches!(
            src.export_block(&seq, 0, &mut bytes),
            Err(Error::Released { .. })
        ));
    }
}
