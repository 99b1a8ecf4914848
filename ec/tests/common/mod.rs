//! Helpers shared by the integration tests.
#![allow(dead_code)]

use nvstore_ec::{Backend, Codec, Profile, Shard};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One codec per backend this CPU can run (always at least the portable one).
pub fn codecs(profile: Profile) -> Vec<Codec> {
    let all: Vec<Codec> = Backend::ALL
        .into_iter()
        .filter_map(|b| Codec::with_backend(profile, b).ok())
        .collect();
    assert!(all.iter().any(|c| c.backend() == Backend::Portable));
    all
}

pub fn profile(k: usize, m: usize) -> Profile {
    Profile::new(k, m, 4096).unwrap()
}

pub fn random_shards(rng: &mut ChaCha8Rng, count: usize, len: usize) -> Vec<Vec<u8>> {
    (0..count)
        .map(|_| (0..len).map(|_| rng.gen()).collect())
        .collect()
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Encodes `data` (k shards) and returns all k + m shards.
pub fn encode_all(codec: &Codec, data: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let len = data[0].len();
    let mut parity = vec![vec![0u8; len]; codec.profile().m()];
    let d: Vec<&[u8]> = data.iter().map(|s| s.as_slice()).collect();
    let mut p: Vec<&mut [u8]> = parity.iter_mut().map(|s| s.as_mut_slice()).collect();
    codec.encode(&d, &mut p);
    data.iter().cloned().chain(parity).collect()
}

/// Drops the shards in `lost`, rebuilds them all, and returns what was rebuilt (in order).
pub fn rebuild(codec: &Codec, stripe: &[Vec<u8>], lost: &[usize]) -> Vec<Vec<u8>> {
    let len = stripe[0].len();
    let mut out = vec![vec![0xA5u8; len]; lost.len()];
    let mut outs = out.iter_mut();
    let mut shards: Vec<Shard<'_>> = stripe
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if lost.contains(&i) {
                Shard::Wanted(outs.next().unwrap())
            } else {
                Shard::Present(s)
            }
        })
        .collect();
    codec.reconstruct(&mut shards).expect("enough shards");
    drop(shards);
    out
}

/// Every subset of `0..n` with exactly `size` elements, ascending.
pub fn subsets(n: usize, size: usize) -> Vec<Vec<usize>> {
    let mut all = Vec::new();
    for mask in 0u64..1 << n {
        if mask.count_ones() as usize == size {
            all.push((0..n).filter(|&i| mask & (1 << i) != 0).collect());
        }
    }
    all
}

pub fn parse_hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}
