//! Bulk GF(2^8) matrix × shards products, on one of three backends chosen at run time.
//!
//! | backend | needs | what |
//! | --- | --- | --- |
//! | [`Backend::Gfni`] | x86_64 with AVX-512F, AVX-512BW, GFNI | `vgf2p8affineqb`, `std::arch` |
//! | [`Backend::RseSimd`] | what reed-solomon-erasure's C was built for (`-march=haswell`) | its `mul_slice` |
//! | [`Backend::Portable`] | nothing | product tables in safe Rust |
//!
//! All three compute the same bytes for the same matrix (tested, including against the
//! committed known-answer vectors). [`Backend::best`] picks the first one this CPU can run; a
//! backend is only ever constructed into a [`Kernel`] after its CPU check passed, so no path
//! executes an instruction the CPU lacks.

#[cfg(target_arch = "x86_64")]
mod gfni;
mod portable;
pub(crate) mod rse;

use crate::gf::{self, Matrix};
use crate::Error;

/// Which implementation does the bulk arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// AVX-512 + GFNI kernel in this crate (`vgf2p8affineqb`).
    Gfni,
    /// reed-solomon-erasure's `simd-accel` C kernel (AVX2 when built with its default
    /// `-march=haswell`).
    RseSimd,
    /// Safe Rust with 256-byte product tables; runs anywhere.
    Portable,
}

impl Backend {
    /// Every backend, fastest first.
    pub const ALL: [Backend; 3] = [Backend::Gfni, Backend::RseSimd, Backend::Portable];

    /// The fastest backend this CPU can run.
    pub fn best() -> Backend {
        Backend::ALL
            .into_iter()
            .find(|b| b.missing_features().is_empty())
            .expect("the portable backend needs no CPU feature")
    }

    /// The CPU features this backend needs and this CPU lacks; empty when it can run here.
    pub fn missing_features(self) -> Vec<&'static str> {
        match self {
            Backend::Gfni => gfni_missing(),
            Backend::RseSimd => rse::missing_features(),
            Backend::Portable => Vec::new(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Gfni => "gfni-avx512",
            Backend::RseSimd => "reed-solomon-erasure-simd",
            Backend::Portable => "portable",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(target_arch = "x86_64")]
fn gfni_missing() -> Vec<&'static str> {
    let mut missing = Vec::new();
    if !is_x86_feature_detected!("avx512f") {
        missing.push("avx512f");
    }
    if !is_x86_feature_detected!("avx512bw") {
        missing.push("avx512bw");
    }
    if !is_x86_feature_detected!("gfni") {
        missing.push("gfni");
    }
    missing
}

#[cfg(not(target_arch = "x86_64"))]
fn gfni_missing() -> Vec<&'static str> {
    vec!["x86_64"]
}

/// A backend whose CPU requirements were checked on this machine.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Kernel {
    backend: Backend,
}

/// A coefficient matrix in the form its backend consumes, built once (at codec construction or
/// on the first use of an erasure pattern) and reused for every stripe.
#[derive(Debug)]
pub(crate) struct Prepared {
    rows: usize,
    cols: usize,
    /// Row-major coefficients (the RseSimd backend uses them directly).
    coeffs: Vec<u8>,
    /// `gf::gfni_matrix` of each coefficient (Gfni backend only).
    gfni: Vec<u64>,
    /// `gf::mul_table` of each coefficient (Portable backend only).
    tables: Vec<[u8; 256]>,
}

impl Kernel {
    pub(crate) fn new(backend: Backend) -> Result<Kernel, Error> {
        let missing = backend.missing_features();
        if !missing.is_empty() {
            return Err(Error::BackendUnavailable { backend, missing });
        }
        Ok(Kernel { backend })
    }

    pub(crate) fn backend(self) -> Backend {
        self.backend
    }

    pub(crate) fn prepare(self, matrix: &Matrix) -> Prepared {
        let coeffs: Vec<u8> = (0..matrix.rows())
            .flat_map(|r| matrix.row(r).iter().copied())
            .collect();
        let gfni = match self.backend {
            Backend::Gfni => coeffs.iter().map(|&c| gf::gfni_matrix(c)).collect(),
            _ => Vec::new(),
        };
        let tables = match self.backend {
            Backend::Portable => coeffs.iter().map(|&c| gf::mul_table(c)).collect(),
            _ => Vec::new(),
        };
        Prepared {
            rows: matrix.rows(),
            cols: matrix.cols(),
            coeffs,
            gfni,
            tables,
        }
    }

    /// outputs = matrix · inputs, or outputs += matrix · inputs when `accumulate`.
    ///
    /// # Panics
    /// If the shapes disagree with `matrix`, lengths differ, or `matrix` was prepared by a
    /// kernel of another backend.
    pub(crate) fn apply(
        self,
        matrix: &Prepared,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
        accumulate: bool,
    ) {
        assert_eq!(inputs.len(), matrix.cols, "input count vs matrix columns");
        assert_eq!(outputs.len(), matrix.rows, "output count vs matrix rows");
        assert!(inputs.len() <= crate::SHARD_COUNT_MAX);
        let len = inputs.first().map_or(0, |s| s.len());
        assert!(
            inputs.iter().all(|s| s.len() == len) && outputs.iter().all(|s| s.len() == len),
            "all shards of one operation have the same length"
        );
        if len == 0 || outputs.is_empty() {
            return;
        }
        match self.backend {
            Backend::Gfni => self.apply_gfni(matrix, inputs, outputs, accumulate),
            Backend::RseSimd => rse::apply(&matrix.coeffs, inputs, outputs, accumulate),
            Backend::Portable => {
                assert_eq!(
                    matrix.tables.len(),
                    matrix.coeffs.len(),
                    "prepared elsewhere"
                );
                portable::apply(&matrix.tables, inputs, outputs, accumulate)
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn apply_gfni(
        self,
        matrix: &Prepared,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
        accumulate: bool,
    ) {
        assert_eq!(matrix.gfni.len(), matrix.coeffs.len(), "prepared elsewhere");
        // SAFETY: a Kernel with Backend::Gfni exists only after `Kernel::new` found AVX-512F,
        // AVX-512BW and GFNI on this CPU; shapes and lengths were asserted by `apply`.
        unsafe { gfni::apply(&matrix.gfni, inputs, outputs, accumulate) }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn apply_gfni(self, _: &Prepared, _: &[&[u8]], _: &mut [&mut [u8]], _: bool) {
        unreachable!("Kernel::new refuses Backend::Gfni off x86_64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernels() -> Vec<Kernel> {
        Backend::ALL
            .into_iter()
            .filter_map(|b| Kernel::new(b).ok())
            .collect()
    }

    #[test]
    fn best_backend_on_this_machine_is_available() {
        let best = Backend::best();
        assert!(Kernel::new(best).is_ok());
        assert!(Kernel::new(Backend::Portable).is_ok());
        eprintln!(
            "best backend here: {best}; reed-solomon-erasure -march: {:?}",
            rse::MARCH
        );
    }

    /// Every product c·x for all 65536 pairs, through each backend as a 1×1 matrix.
    #[test]
    fn every_backend_multiplies_every_pair() {
        let x: Vec<u8> = (0..=255u8).collect();
        for kernel in kernels() {
            for c in 0..=255u8 {
                let mut m = Matrix::zero(1, 1);
                m.set(0, 0, c);
                let p = kernel.prepare(&m);
                let mut out = vec![0xEEu8; 256];
                kernel.apply(&p, &[&x], &mut [&mut out], false);
                let want: Vec<u8> = x.iter().map(|&v| gf::mul(c, v)).collect();
                assert_eq!(out, want, "{} c={c}", kernel.backend());
                kernel.apply(&p, &[&x], &mut [&mut out], true);
                assert!(
                    out.iter().all(|&b| b == 0),
                    "{} accumulate c={c}",
                    kernel.backend()
                );
            }
        }
    }

    /// Many rows (several GFNI groups, several length blocks) and odd lengths agree across
    /// backends.
    #[test]
    fn backends_agree_on_wide_matrices_and_odd_lengths() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut shapes = vec![(9, 5, 40_000), (13, 6, 20_000)];
        for rows in 1..=6 {
            for cols in 1..=7 {
                for len in [1, 63, 64, 65, 255, 256, 257, 700] {
                    shapes.push((rows, cols, len));
                }
            }
        }
        for (rows, cols, len) in shapes {
            let mut m = Matrix::zero(rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    m.set(r, c, rng.gen());
                }
            }
            let ins: Vec<Vec<u8>> = (0..cols)
                .map(|_| (0..len).map(|_| rng.gen()).collect())
                .collect();
            let init: Vec<Vec<u8>> = (0..rows)
                .map(|_| (0..len).map(|_| rng.gen()).collect())
                .collect();
            let in_refs: Vec<&[u8]> = ins.iter().map(|v| v.as_slice()).collect();
            let mut results = Vec::new();
            for kernel in kernels() {
                let p = kernel.prepare(&m);
                for accumulate in [false, true] {
                    let mut outs = init.clone();
                    let mut out_refs: Vec<&mut [u8]> =
                        outs.iter_mut().map(|v| v.as_mut_slice()).collect();
                    kernel.apply(&p, &in_refs, &mut out_refs, accumulate);
                    results.push((kernel.backend(), accumulate, outs));
                }
            }
            // The definition, byte by byte.
            let naive = |accumulate: bool| -> Vec<Vec<u8>> {
                (0..rows)
                    .map(|r| {
                        (0..len)
                            .map(|i| {
                                let start = if accumulate { init[r][i] } else { 0 };
                                (0..cols).fold(start, |a, c| a ^ gf::mul(m.get(r, c), ins[c][i]))
                            })
                            .collect()
                    })
                    .collect()
            };
            let (want_set, want_acc) = (naive(false), naive(true));
            assert!(
                results.len() >= 2 * 2,
                "at least the portable and one SIMD backend"
            );
            for (b, acc, outs) in &results {
                let want = if *acc { &want_acc } else { &want_set };
                assert!(
                    want == outs,
                    "{b} accumulate={acc} rows={rows} cols={cols} len={len}"
                );
            }
        }
    }
}
