//! The codec's contract: MDS recovery for every erasure pattern, parity deltas equal to full
//! re-encodes, verification, byte-identity with reed-solomon-erasure, and the decode cache.

mod common;

use common::{codecs, encode_all, profile, random_shards, rebuild, rng, subsets};
use nvstore_ec::{Backend, Codec, Error, Shard, ShardSet};
use proptest::prelude::*;
use rand::Rng;

/// Every pattern of exactly `lost` erasures (and every smaller one) rebuilds the lost shards.
fn check_all_patterns(codec: &Codec, stripe: &[Vec<u8>], lost: usize) -> usize {
    let n = codec.profile().shard_count();
    let mut patterns = 0;
    for size in 1..=lost {
        for pattern in subsets(n, size) {
            let got = rebuild(codec, stripe, &pattern);
            for (i, &s) in pattern.iter().enumerate() {
                assert!(got[i] == stripe[s], "{} lost {pattern:?}", codec.backend());
            }
            patterns += 1;
        }
    }
    patterns
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// 6+2: all 28 two-shard erasure patterns (and the 8 single ones), random data and sizes.
    #[test]
    fn mds_6_2_every_two_erasure_pattern(seed in any::<u64>(), len in 1usize..6000) {
        let data = random_shards(&mut rng(seed), 6, len);
        for codec in codecs(profile(6, 2)) {
            let stripe = encode_all(&codec, &data);
            prop_assert_eq!(subsets(8, 2).len(), 28);
            prop_assert_eq!(check_all_patterns(&codec, &stripe, 2), 28 + 8);
        }
    }

    #[test]
    fn mds_4_2_every_pattern(seed in any::<u64>(), len in 1usize..3000) {
        let data = random_shards(&mut rng(seed), 4, len);
        for codec in codecs(profile(4, 2)) {
            let stripe = encode_all(&codec, &data);
            prop_assert_eq!(check_all_patterns(&codec, &stripe, 2), 15 + 6);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// 8+3: all 165 three-shard erasure patterns (and the 55 + 11 smaller ones).
    #[test]
    fn mds_8_3_every_pattern(seed in any::<u64>(), len in 1usize..2000) {
        let data = random_shards(&mut rng(seed), 8, len);
        for codec in codecs(profile(8, 3)) {
            let stripe = encode_all(&codec, &data);
            prop_assert_eq!(check_all_patterns(&codec, &stripe, 3), 165 + 55 + 11);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Overwrite a random range of a random data shard; parity_delta on just that range gives
    /// the parity a full re-encode of the new stripe gives.
    #[test]
    fn parity_delta_equals_full_reencode(
        seed in any::<u64>(),
        (k, m) in prop_oneof![Just((6usize, 2usize)), Just((4, 2)), Just((8, 3)), Just((3, 1))],
        len in 1usize..5000,
        updates in 1usize..4,
    ) {
        let mut rng = rng(seed);
        let data = random_shards(&mut rng, k, len);
        for codec in codecs(profile(k, m)) {
            let mut stripe = encode_all(&codec, &data);
            for _ in 0..updates {
                let shard = rng.gen_range(0..k);
                let start = rng.gen_range(0..len);
                let end = rng.gen_range(start + 1..=len);
                let new: Vec<u8> = (start..end).map(|_| rng.gen()).collect();
                let old = stripe[shard][start..end].to_vec();
                let (_, parity) = stripe.split_at_mut(k);
                let mut p: Vec<&mut [u8]> =
                    parity.iter_mut().map(|s| &mut s[start..end]).collect();
                codec.parity_delta(shard, &old, &new, &mut p);
                stripe[shard][start..end].copy_from_slice(&new);
            }
            let reencoded = encode_all(&codec, &stripe[..k]);
            prop_assert!(reencoded == stripe, "{}", codec.backend());
        }
    }

    /// The GFNI and reed-solomon-erasure paths produce the same parity as reed-solomon-erasure
    /// itself, for random data, lengths and profiles.
    #[test]
    fn parity_is_byte_identical_to_reed_solomon_erasure(
        seed in any::<u64>(),
        k in 1usize..=12,
        m in 1usize..=5,
        len in 1usize..3000,
    ) {
        if !Backend::RseSimd.missing_features().is_empty() {
            return Ok(()); // reed-solomon-erasure's C kernel would SIGILL on this CPU
        }
        let data = random_shards(&mut rng(seed), k, len);
        let rs = reed_solomon_erasure::galois_8::ReedSolomon::new(k, m).unwrap();
        let mut want = vec![vec![0u8; len]; m];
        rs.encode_sep(&data, &mut want).unwrap();
        for codec in codecs(profile(k, m)) {
            let stripe = encode_all(&codec, &data);
            prop_assert!(stripe[k..] == want[..], "{} {k}+{m} len {len}", codec.backend());
        }
    }
}

#[test]
fn verify_reports_mismatching_parity() {
    let mut rng = rng(11);
    // Longer than the verify scratch, so several chunks are compared.
    let data = random_shards(&mut rng, 6, 40_000);
    for codec in codecs(profile(6, 2)) {
        let stripe = encode_all(&codec, &data);
        let view = |s: &[Vec<u8>]| -> ShardSet {
            codec.verify(&s.iter().map(|x| x.as_slice()).collect::<Vec<_>>())
        };
        assert!(view(&stripe).is_empty());
        let mut bad = stripe.clone();
        bad[7][39_999] ^= 1;
        assert_eq!(view(&bad), [7].into_iter().collect());
        let mut bad = stripe.clone();
        bad[6][0] ^= 0x80;
        bad[7][20_000] ^= 0x01;
        assert_eq!(view(&bad), [6, 7].into_iter().collect());
        let mut bad = stripe.clone();
        bad[3][12_345] ^= 0x10;
        // Every parity coefficient is non-zero, so a data error shows in every parity shard.
        assert_eq!(view(&bad), [6, 7].into_iter().collect());
    }
}

#[test]
fn too_many_erasures_is_an_error_and_leaves_buffers_alone() {
    let data = random_shards(&mut rng(3), 6, 100);
    let codec = Codec::new(profile(6, 2));
    let stripe = encode_all(&codec, &data);
    let (mut a, mut b) = (vec![9u8; 100], vec![9u8; 100]);
    let mut shards = [
        Shard::Wanted(&mut a),
        Shard::Wanted(&mut b),
        Shard::Missing,
        Shard::Present(&stripe[3]),
        Shard::Present(&stripe[4]),
        Shard::Present(&stripe[5]),
        Shard::Present(&stripe[6]),
        Shard::Present(&stripe[7]),
    ];
    let err = codec.reconstruct(&mut shards).unwrap_err();
    assert!(
        matches!(
            err,
            Error::TooFewShards {
                present: 5,
                needed: 6
            }
        ),
        "{err}"
    );
    assert!(a.iter().chain(&b).all(|&x| x == 9));
}

/// Only the wanted shards are written; a missing shard that is not wanted stays untouched and
/// more than k present shards are fine.
#[test]
fn reconstruct_only_wanted_shards() {
    let data = random_shards(&mut rng(5), 6, 1000);
    let codec = Codec::new(profile(6, 2));
    let stripe = encode_all(&codec, &data);
    let mut rebuilt = vec![0u8; 1000];
    let mut shards: Vec<Shard<'_>> = stripe.iter().map(|s| Shard::Present(s)).collect();
    shards[2] = Shard::Missing;
    shards[7] = Shard::Wanted(&mut rebuilt);
    codec.reconstruct(&mut shards).unwrap();
    drop(shards);
    assert!(rebuilt == stripe[7]);
    // Nothing wanted: nothing to do, even with too few shards.
    let mut shards: Vec<Shard<'_>> = (0..8).map(|_| Shard::Missing).collect();
    codec.reconstruct(&mut shards).unwrap();
}

#[test]
fn decode_matrices_are_cached_per_pattern() {
    let data = random_shards(&mut rng(9), 6, 256);
    let codec = Codec::new(profile(6, 2));
    let stripe = encode_all(&codec, &data);
    assert_eq!(codec.decode_cache_len(), 0);
    for _ in 0..3 {
        for pattern in subsets(8, 2) {
            rebuild(&codec, &stripe, &pattern);
        }
    }
    // 28 patterns, each its own (sources, wanted) key; repeats hit the cache.
    assert_eq!(codec.decode_cache_len(), 28);
}

#[test]
fn codec_is_shared_across_threads() {
    let codec = Codec::new(profile(6, 2));
    let data = random_shards(&mut rng(1), 6, 4096);
    let stripe = encode_all(&codec, &data);
    std::thread::scope(|s| {
        for t in 0..2 {
            let (codec, stripe) = (&codec, &stripe);
            s.spawn(move || {
                for pattern in subsets(8, 2).into_iter().skip(t) {
                    let got = rebuild(codec, stripe, &pattern);
                    assert!(got[0] == stripe[pattern[0]] && got[1] == stripe[pattern[1]]);
                }
            });
        }
    });
}

#[test]
fn unavailable_backend_is_a_clear_error() {
    for b in Backend::ALL {
        let missing = b.missing_features();
        match Codec::with_backend(profile(6, 2), b) {
            Ok(c) => assert!(missing.is_empty() && c.backend() == b),
            Err(Error::BackendUnavailable {
                backend,
                missing: m,
            }) => {
                assert_eq!((backend, m), (b, missing));
            }
            Err(e) => panic!("{e}"),
        }
    }
    let (march, required) = nvstore_ec::rse_build_requirements();
    if march.is_empty() && cfg!(target_arch = "x86_64") {
        // reed-solomon-erasure's default: -march=haswell.
        let required = required.expect("haswell is checkable");
        for f in ["avx2", "fma", "bmi2", "lzcnt", "movbe"] {
            assert!(required.contains(&f), "{f}");
        }
    }
}

/// Growing an object inside its last stripe writes into zero padding: a parity delta whose old
/// data is zero, matching an encode of the grown stripe.
#[test]
fn append_into_padding_is_a_delta_from_zero() {
    let p = nvstore_ec::Profile::new(6, 2, 4096).unwrap();
    let codec = Codec::new(p);
    let mut rng = rng(21);
    let mut object: Vec<u8> = (0..10_000).map(|_| rng.gen()).collect();
    let stripe_of = |object: &[u8]| -> Vec<Vec<u8>> {
        let mut padded = object.to_vec();
        padded.resize(
            (p.stripe_count(object.len() as u64) * p.stripe_width()) as usize,
            0,
        );
        padded.chunks(4096).map(|c| c.to_vec()).collect()
    };
    let mut stripe = encode_all(&codec, &stripe_of(&object));
    let appended: Vec<u8> = (0..7_000).map(|_| rng.gen()).collect();
    for e in p.extents(object.len() as u64, appended.len() as u64) {
        assert_eq!(e.stripe, 0);
        let at = (e.shard_offset % 4096) as usize;
        let new = &appended[(e.object_offset as usize - object.len())..][..e.len];
        let old = &stripe[e.shard][at..at + e.len];
        assert!(old.iter().all(|&b| b == 0), "padding is zero");
        let zeros = vec![0u8; e.len];
        let (_, parity) = stripe.split_at_mut(6);
        let mut par: Vec<&mut [u8]> = parity.iter_mut().map(|s| &mut s[at..at + e.len]).collect();
        codec.parity_delta(e.shard, &zeros, new, &mut par);
        stripe[e.shard][at..at + e.len].copy_from_slice(new);
    }
    object.extend_from_slice(&appended);
    assert!(encode_all(&codec, &stripe_of(&object)) == stripe);
}

#[test]
#[should_panic(expected = "encode takes k data shards")]
fn encode_with_wrong_shard_count_panics() {
    let codec = Codec::new(profile(6, 2));
    let d = vec![0u8; 64];
    let mut p = vec![vec![0u8; 64]; 2];
    let mut p: Vec<&mut [u8]> = p.iter_mut().map(|s| s.as_mut_slice()).collect();
    codec.encode(&[d.as_slice(); 5], &mut p);
}

#[test]
#[should_panic(expected = "differs in length")]
fn reconstruct_with_unequal_lengths_panics() {
    let codec = Codec::new(profile(4, 2));
    let (a, b) = (vec![0u8; 64], vec![0u8; 65]);
    let mut out = vec![0u8; 64];
    let mut shards = [
        Shard::Wanted(&mut out),
        Shard::Present(&a),
        Shard::Present(&a),
        Shard::Present(&a),
        Shard::Present(&b),
        Shard::Missing,
    ];
    let _ = codec.reconstruct(&mut shards);
}
