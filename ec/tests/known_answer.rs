//! Known-answer vectors: parity bytes pinned across versions, on every backend.
//!
//! `tests/vectors/rs_K_M.txt` were produced once by reed-solomon-erasure 6.0.0 (pure Rust,
//! `ReedSolomon::new(k, m).encode()`), see `tests/vectors/README.md`. Shards on disk were
//! written with these exact bytes; a change that breaks this test breaks every stored object.

mod common;

use common::{codecs, encode_all, parse_hex, profile, rebuild, subsets};
use nvstore_ec::{Backend, Codec};

struct Vector {
    k: usize,
    m: usize,
    /// `coefficients[i][j]`: data shard j in parity shard k + i.
    coefficients: Vec<Vec<u8>>,
    shards: Vec<Vec<u8>>,
}

fn load(name: &str) -> Vector {
    let path = format!("{}/tests/vectors/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let (mut k, mut m, mut len) = (0, 0, 0);
    let (mut coefficients, mut shards) = (Vec::new(), Vec::new());
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f[0] {
            "k" => k = f[1].parse().unwrap(),
            "m" => m = f[1].parse().unwrap(),
            "len" => len = f[1].parse().unwrap(),
            "coefficients" => {
                assert_eq!(f[1].parse::<usize>().unwrap(), k + coefficients.len());
                coefficients.push(parse_hex(f[2]));
            }
            "shard" => {
                assert_eq!(f[1].parse::<usize>().unwrap(), shards.len());
                shards.push(parse_hex(f[2]));
            }
            other => panic!("{path}: unknown field {other}"),
        }
    }
    assert_eq!(coefficients.len(), m);
    assert_eq!(shards.len(), k + m);
    assert!(shards.iter().all(|s| s.len() == len));
    Vector {
        k,
        m,
        coefficients,
        shards,
    }
}

const VECTORS: [&str; 3] = ["rs_6_2.txt", "rs_4_2.txt", "rs_8_3.txt"];

#[test]
fn coding_matrix_matches_vectors() {
    for name in VECTORS {
        let v = load(name);
        for codec in codecs(profile(v.k, v.m)) {
            for i in 0..v.m {
                let row: Vec<u8> = (0..v.k).map(|j| codec.coefficient(i, j)).collect();
                assert_eq!(row, v.coefficients[i], "{name} parity row {i}");
            }
        }
    }
}

#[test]
fn every_backend_encodes_the_vectors() {
    for name in VECTORS {
        let v = load(name);
        for codec in codecs(profile(v.k, v.m)) {
            let all = encode_all(&codec, &v.shards[..v.k]);
            assert!(all == v.shards, "{name} on {}", codec.backend());
            let stripe: Vec<u8> = v.shards[..v.k].concat();
            let mut parity = vec![vec![0u8; v.shards[0].len()]; v.m];
            let mut p: Vec<&mut [u8]> = parity.iter_mut().map(|s| s.as_mut_slice()).collect();
            codec.encode_stripe(&stripe, &mut p);
            assert!(
                parity == v.shards[v.k..],
                "{name} encode_stripe on {}",
                codec.backend()
            );
        }
    }
}

#[test]
fn every_backend_decodes_the_vectors_from_any_k_shards() {
    for name in VECTORS {
        let v = load(name);
        for codec in codecs(profile(v.k, v.m)) {
            for lost in subsets(v.k + v.m, v.m) {
                let got = rebuild(&codec, &v.shards, &lost);
                for (i, &s) in lost.iter().enumerate() {
                    assert!(
                        got[i] == v.shards[s],
                        "{name} {} lost {lost:?}",
                        codec.backend()
                    );
                }
            }
            assert!(codec
                .verify(&v.shards.iter().map(|s| s.as_slice()).collect::<Vec<_>>())
                .is_empty());
        }
    }
}

/// reed-solomon-erasure's own `simd-accel` build (the C kernel this crate links) agrees with
/// the vectors too, so the RseSimd backend and the crate itself are the same code.
#[test]
fn reed_solomon_erasure_simd_build_reproduces_the_vectors() {
    if !Backend::RseSimd.missing_features().is_empty() {
        eprintln!(
            "skipped: reed-solomon-erasure's C kernel cannot run here: {:?}",
            Backend::RseSimd.missing_features()
        );
        return;
    }
    for name in VECTORS {
        let v = load(name);
        let rs = reed_solomon_erasure::galois_8::ReedSolomon::new(v.k, v.m).unwrap();
        let mut parity = vec![vec![0u8; v.shards[0].len()]; v.m];
        rs.encode_sep(&v.shards[..v.k], &mut parity).unwrap();
        assert!(parity == v.shards[v.k..], "{name}");
    }
}

#[test]
fn best_backend_is_gfni_on_avx512_gfni_cpus() {
    let codec = Codec::new(profile(6, 2));
    if Backend::Gfni.missing_features().is_empty() {
        assert_eq!(codec.backend(), Backend::Gfni);
    }
    eprintln!("backend: {}", codec.backend());
}
