//! The reed-solomon-erasure kernel (its `simd-accel` C code) and what it requires of the CPU.
//!
//! reed-solomon-erasure 6.0's build.rs compiles `simd_c/reedsolomon.c` with `cc`, `-O3` and,
//! on x86_64, `-march=haswell` (or `-march=$RUST_REED_SOLOMON_ERASURE_ARCH` when that is set),
//! and every `galois_8::mul_slice{,_xor}` call goes into that C code with no runtime dispatch.
//! `-march=haswell` lets the C compiler emit any Haswell instruction anywhere in that object,
//! not only the AVX2 intrinsics: BMI1/2, LZCNT, MOVBE, FMA, F16C and so on. On a CPU without
//! them the first call dies with SIGILL. So before this backend is used, every feature of the
//! recorded `-march` is checked with `is_x86_feature_detected!`; when one is missing the
//! backend is reported unavailable and the codec runs on another backend instead.

use reed_solomon_erasure::galois_8;

/// `-march=haswell` in GCC and Clang, as named by `is_x86_feature_detected!`. (Haswell also
/// implies FSGSBASE and LAHF/SAHF; compilers emit the first only through intrinsics, which
/// this C code does not use, and the second is in every x86_64 CPU with AVX2.)
const HASWELL: &[&str] = &[
    "sse3",
    "ssse3",
    "sse4.1",
    "sse4.2",
    "popcnt",
    "cmpxchg16b",
    "fxsr",
    "xsave",
    "pclmulqdq",
    "rdrand",
    "avx",
    "avx2",
    "f16c",
    "fma",
    "bmi1",
    "bmi2",
    "lzcnt",
    "movbe",
];
const X86_64_V2: &[&str] = &["sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "cmpxchg16b"];
const X86_64_V3: &[&str] = &[
    "sse3",
    "ssse3",
    "sse4.1",
    "sse4.2",
    "popcnt",
    "cmpxchg16b",
    "avx",
    "avx2",
    "bmi1",
    "bmi2",
    "f16c",
    "fma",
    "lzcnt",
    "movbe",
    "xsave",
];
const X86_64_V4: &[&str] = &[
    "sse3",
    "ssse3",
    "sse4.1",
    "sse4.2",
    "popcnt",
    "cmpxchg16b",
    "avx",
    "avx2",
    "bmi1",
    "bmi2",
    "f16c",
    "fma",
    "lzcnt",
    "movbe",
    "xsave",
    "avx512f",
    "avx512bw",
    "avx512cd",
    "avx512dq",
    "avx512vl",
];

/// The `-march` reed-solomon-erasure's C kernel was built with ("" = its default), recorded by
/// this crate's build.rs from the same environment variable.
pub(crate) const MARCH: &str = env!("NVSTORE_EC_RSE_MARCH");

/// What this build's C kernel requires of the CPU; `None` when the `-march` is not one we can
/// check (e.g. `native`, or a CPU name other than `haswell`).
pub(crate) fn required_features() -> Option<&'static [&'static str]> {
    requirements_for(MARCH)
}

fn requirements_for(march: &str) -> Option<&'static [&'static str]> {
    if !cfg!(target_arch = "x86_64") {
        // Other targets: reed-solomon-erasure passes no -march unless asked to.
        return march.is_empty().then_some(&[][..]);
    }
    match march {
        "" | "haswell" => Some(HASWELL),
        "x86-64" => Some(&[]),
        "x86-64-v2" => Some(X86_64_V2),
        "x86-64-v3" => Some(X86_64_V3),
        "x86-64-v4" => Some(X86_64_V4),
        _ => None,
    }
}

/// The required features this CPU lacks; empty when the C kernel is safe to call.
pub(crate) fn missing_features() -> Vec<&'static str> {
    match required_features() {
        Some(list) => list.iter().copied().filter(|f| !detected(f)).collect(),
        None => vec!["a checkable -march for reed-solomon-erasure's C kernel"],
    }
}

#[cfg(target_arch = "x86_64")]
fn detected(feature: &str) -> bool {
    match feature {
        "sse3" => is_x86_feature_detected!("sse3"),
        "ssse3" => is_x86_feature_detected!("ssse3"),
        "sse4.1" => is_x86_feature_detected!("sse4.1"),
        "sse4.2" => is_x86_feature_detected!("sse4.2"),
        "popcnt" => is_x86_feature_detected!("popcnt"),
        "cmpxchg16b" => is_x86_feature_detected!("cmpxchg16b"),
        "fxsr" => is_x86_feature_detected!("fxsr"),
        "xsave" => is_x86_feature_detected!("xsave"),
        "pclmulqdq" => is_x86_feature_detected!("pclmulqdq"),
        "rdrand" => is_x86_feature_detected!("rdrand"),
        "avx" => is_x86_feature_detected!("avx"),
        "avx2" => is_x86_feature_detected!("avx2"),
        "f16c" => is_x86_feature_detected!("f16c"),
        "fma" => is_x86_feature_detected!("fma"),
        "bmi1" => is_x86_feature_detected!("bmi1"),
        "bmi2" => is_x86_feature_detected!("bmi2"),
        "lzcnt" => is_x86_feature_detected!("lzcnt"),
        "movbe" => is_x86_feature_detected!("movbe"),
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512bw" => is_x86_feature_detected!("avx512bw"),
        "avx512cd" => is_x86_feature_detected!("avx512cd"),
        "avx512dq" => is_x86_feature_detected!("avx512dq"),
        "avx512vl" => is_x86_feature_detected!("avx512vl"),
        other => unreachable!("feature {other} is not in the detection table"),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detected(_feature: &str) -> bool {
    false
}

/// Length blocking: every output row is built block by block so the block of each output
/// stays in L1 while all inputs are folded into it.
const BLOCK_BYTES: usize = 16 * 1024;

/// outputs[r] (=|^=) Σ_c coeffs[r * cols + c] · inputs[c] through `galois_8::mul_slice{,_xor}`.
/// Only called once `missing_features()` came back empty (the `Kernel` constructor checks).
pub(super) fn apply(coeffs: &[u8], inputs: &[&[u8]], outputs: &mut [&mut [u8]], accumulate: bool) {
    let cols = inputs.len();
    let len = inputs.first().map_or(0, |s| s.len());
    let mut start = 0;
    while start < len {
        let end = (start + BLOCK_BYTES).min(len);
        for (r, out) in outputs.iter_mut().enumerate() {
            let out = &mut out[start..end];
            for (c, input) in inputs.iter().enumerate() {
                let coeff = coeffs[r * cols + c];
                if c == 0 && !accumulate {
                    galois_8::mul_slice(coeff, &input[start..end], out);
                } else {
                    galois_8::mul_slice_xor(coeff, &input[start..end], out);
                }
            }
        }
        start = end;
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn march_requirements() {
        assert_eq!(requirements_for(""), Some(HASWELL));
        assert_eq!(requirements_for("haswell"), Some(HASWELL));
        assert_eq!(requirements_for("x86-64"), Some(&[][..]));
        assert!(requirements_for("x86-64-v4").unwrap().contains(&"avx512bw"));
        // Not checkable: refuse the backend rather than guess.
        assert_eq!(requirements_for("native"), None);
        assert_eq!(requirements_for("znver4"), None);
        // Every name in the tables is one `detected` knows (it panics otherwise).
        for list in [HASWELL, X86_64_V2, X86_64_V3, X86_64_V4] {
            for f in list {
                detected(f);
            }
        }
    }
}
