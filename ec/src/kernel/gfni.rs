//! The AVX-512 + GFNI multiply-accumulate kernel.
//!
//! Multiplying a byte by a constant c in GF(2^8) is a linear map over GF(2), so it is an 8×8
//! bit matrix A_c (see `gf::gfni_matrix`), and `vgf2p8affineqb` applies one to 64 bytes at once
//! whatever the field polynomial (unlike `vgf2p8mulb`, which is fixed to 0x11B). An output row
//! is the XOR over the inputs of affine(input_j, A_ij): one instruction and one XOR per input
//! per output per 64 bytes, with each input vector loaded once for up to `GROUP_MAX` outputs.
//! ISA-L's AVX-512 kernel needs two `vpshufb`, a shift, two ANDs and two XORs for the same.
//! Inputs are folded in pairs with one three-way XOR (`vpternlogq`), and each step covers
//! `UNROLL` vectors per output so the matrices are broadcast once per 256 bytes.
//!
//! Tails shorter than 64 bytes use masked loads and stores, which do not touch (or fault on)
//! the masked-off bytes, so there is no scalar tail loop.

use core::arch::x86_64::{
    __m512i, __mmask64, _mm512_gf2p8affine_epi64_epi8, _mm512_loadu_si512, _mm512_mask_storeu_epi8,
    _mm512_maskz_loadu_epi8, _mm512_set1_epi64, _mm512_setzero_si512, _mm512_storeu_si512,
    _mm512_ternarylogic_epi64, _mm512_xor_si512,
};

use crate::SHARD_COUNT_MAX;

/// Outputs computed per pass over the inputs (see `UNROLL` for the register budget).
const GROUP_MAX: usize = 4;

/// When more than `GROUP_MAX` outputs need several passes, the data is walked in blocks of this
/// many bytes so each pass after the first reads its inputs from L1/L2 rather than memory.
const BLOCK_BYTES: usize = 16 * 1024;

const VECTOR_BYTES: usize = 64;

/// Vectors per output row per step of the main loop: G × UNROLL accumulators, 2 × UNROLL
/// input vectors and two broadcast matrices fit the 32 zmm registers for G <= `GROUP_MAX`.
const UNROLL: usize = 4;
const STEP_BYTES: usize = UNROLL * VECTOR_BYTES;

/// outputs[r] (=|^=) Σ_c A[r][c] · inputs[c], where A[r][c] is the bit matrix `mats[r * cols + c]`.
///
/// # Safety
/// The CPU supports AVX-512F, AVX-512BW and GFNI. `mats.len() == outputs.len() * inputs.len()`,
/// `inputs.len() <= SHARD_COUNT_MAX`, and every input and output has the same length.
#[target_feature(enable = "avx512f,avx512bw,gfni")]
pub(super) unsafe fn apply(
    mats: &[u64],
    inputs: &[&[u8]],
    outputs: &mut [&mut [u8]],
    accumulate: bool,
) {
    let (rows, cols) = (outputs.len(), inputs.len());
    debug_assert_eq!(mats.len(), rows * cols);
    debug_assert!(cols <= SHARD_COUNT_MAX);
    let len = inputs.first().map_or(0, |s| s.len());
    let block = if rows <= GROUP_MAX { len } else { BLOCK_BYTES };
    let mut start = 0;
    while start < len {
        let n = block.min(len - start);
        let mut ins = [core::ptr::null::<u8>(); SHARD_COUNT_MAX];
        for (p, s) in ins.iter_mut().zip(inputs) {
            *p = s[start..].as_ptr();
        }
        let ins = &ins[..cols];
        let mut r0 = 0;
        while r0 < rows {
            let g = (rows - r0).min(GROUP_MAX);
            let mut outs = [core::ptr::null_mut::<u8>(); GROUP_MAX];
            for (p, s) in outs.iter_mut().zip(&mut outputs[r0..r0 + g]) {
                *p = s[start..].as_mut_ptr();
            }
            let m = &mats[r0 * cols..(r0 + g) * cols];
            // SAFETY: the caller guarantees the CPU features; `ins` and `outs[..g]` point at
            // `n` readable / writable bytes each (all slices have length `len` and
            // `start + n <= len`), and `m` holds g × cols matrices.
            unsafe {
                match (g, accumulate) {
                    (1, false) => rows_kernel::<1, false>(m, ins, outs, n),
                    (2, false) => rows_kernel::<2, false>(m, ins, outs, n),
                    (3, false) => rows_kernel::<3, false>(m, ins, outs, n),
                    (4, false) => rows_kernel::<4, false>(m, ins, outs, n),
                    (1, true) => rows_kernel::<1, true>(m, ins, outs, n),
                    (2, true) => rows_kernel::<2, true>(m, ins, outs, n),
                    (3, true) => rows_kernel::<3, true>(m, ins, outs, n),
                    (4, true) => rows_kernel::<4, true>(m, ins, outs, n),
                    _ => unreachable!("group size {g} out of 1..={GROUP_MAX}"),
                }
            }
            r0 += g;
        }
        start += n;
    }
}

/// G output rows over `len` bytes: `UNROLL` vectors per step, then single (masked) vectors.
///
/// # Safety
/// CPU features as for [`apply`]; every `ins[c]` is readable and `outs[..G]` writable for
/// `len` bytes; `mats.len() == G * ins.len()`.
#[target_feature(enable = "avx512f,avx512bw,gfni")]
#[inline]
unsafe fn rows_kernel<const G: usize, const ACC: bool>(
    mats: &[u64],
    ins: &[*const u8],
    outs: [*mut u8; GROUP_MAX],
    len: usize,
) {
    let cols = ins.len();
    let mut off = 0;
    while off + STEP_BYTES <= len {
        let mut acc = [[_mm512_setzero_si512(); UNROLL]; G];
        if ACC {
            for g in 0..G {
                // SAFETY: off + STEP_BYTES <= len, and outs[g] is readable for len bytes.
                acc[g] = unsafe { load_step(outs[g].add(off)) };
            }
        }
        // Inputs two at a time: one three-way XOR (vpternlogq) folds both products in.
        let mut c = 0;
        while c + 1 < cols {
            // SAFETY: c + 1 < cols = ins.len(); off + STEP_BYTES <= len and the inputs are
            // readable for len bytes.
            let (x, y) = unsafe { (load_step(ins[c].add(off)), load_step(ins[c + 1].add(off))) };
            fold_pair(&mut acc, mats, cols, c, &x, &y);
            c += 2;
        }
        if c < cols {
            // SAFETY: as above, for the last input.
            let x = unsafe { load_step(ins[c].add(off)) };
            fold_one(&mut acc, mats, cols, c, &x);
        }
        for g in 0..G {
            // SAFETY: off + STEP_BYTES <= len, and outs[g] is writable for len bytes.
            unsafe { store_step(outs[g].add(off), &acc[g]) };
        }
        off += STEP_BYTES;
    }
    while off < len {
        let n = (len - off).min(VECTOR_BYTES);
        // SAFETY: n bytes from `off` are in bounds of every input and output.
        unsafe { rows_vector::<G, ACC>(mats, ins, outs, off, n) };
        off += n;
    }
}

/// acc[g][u] ^= A[g][c]·x[u] ^ A[g][c+1]·y[u] for every output g.
#[target_feature(enable = "avx512f,gfni")]
#[inline]
fn fold_pair<const G: usize>(
    acc: &mut [[__m512i; UNROLL]; G],
    mats: &[u64],
    cols: usize,
    c: usize,
    x: &[__m512i; UNROLL],
    y: &[__m512i; UNROLL],
) {
    for (g, acc) in acc.iter_mut().enumerate() {
        let a = _mm512_set1_epi64(mats[g * cols + c] as i64);
        let b = _mm512_set1_epi64(mats[g * cols + c + 1] as i64);
        for u in 0..UNROLL {
            let pa = _mm512_gf2p8affine_epi64_epi8::<0>(x[u], a);
            let pb = _mm512_gf2p8affine_epi64_epi8::<0>(y[u], b);
            acc[u] = _mm512_ternarylogic_epi64::<0x96>(acc[u], pa, pb);
        }
    }
}

/// acc[g][u] ^= A[g][c]·x[u] for every output g.
#[target_feature(enable = "avx512f,gfni")]
#[inline]
fn fold_one<const G: usize>(
    acc: &mut [[__m512i; UNROLL]; G],
    mats: &[u64],
    cols: usize,
    c: usize,
    x: &[__m512i; UNROLL],
) {
    for (g, acc) in acc.iter_mut().enumerate() {
        let a = _mm512_set1_epi64(mats[g * cols + c] as i64);
        for u in 0..UNROLL {
            acc[u] = _mm512_xor_si512(acc[u], _mm512_gf2p8affine_epi64_epi8::<0>(x[u], a));
        }
    }
}

/// G output rows over `n` <= 64 bytes at `off`, with masked loads and stores.
///
/// # Safety
/// CPU features as for [`apply`]; bytes `off..off + n` of every `ins[c]` are readable and of
/// `outs[..G]` writable; `mats.len() == G * ins.len()`.
#[target_feature(enable = "avx512f,avx512bw,gfni")]
#[inline]
unsafe fn rows_vector<const G: usize, const ACC: bool>(
    mats: &[u64],
    ins: &[*const u8],
    outs: [*mut u8; GROUP_MAX],
    off: usize,
    n: usize,
) {
    debug_assert!((1..=VECTOR_BYTES).contains(&n));
    let mask: __mmask64 = u64::MAX >> (VECTOR_BYTES - n);
    let cols = ins.len();
    let mut acc = [_mm512_setzero_si512(); G];
    if ACC {
        for g in 0..G {
            // SAFETY: the mask selects bytes off..off + n of outs[g], which are readable.
            acc[g] = unsafe { load_masked(outs[g].add(off), mask) };
        }
    }
    for (c, &input) in ins.iter().enumerate() {
        // SAFETY: the mask selects bytes off..off + n of ins[c], which are readable.
        let x = unsafe { load_masked(input.add(off), mask) };
        for (g, acc) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_epi64(mats[g * cols + c] as i64);
            *acc = _mm512_xor_si512(*acc, _mm512_gf2p8affine_epi64_epi8::<0>(x, a));
        }
    }
    for g in 0..G {
        // SAFETY: the mask selects bytes off..off + n of outs[g], which are writable.
        unsafe { store_masked(outs[g].add(off), mask, acc[g]) };
    }
}

/// # Safety
/// `STEP_BYTES` bytes at `p` are readable; the CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_step(p: *const u8) -> [__m512i; UNROLL] {
    // SAFETY: u * 64 + 64 <= STEP_BYTES bytes at p are readable.
    std::array::from_fn(|u| unsafe { load(p.add(u * VECTOR_BYTES)) })
}

/// # Safety
/// `STEP_BYTES` bytes at `p` are writable; the CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_step(p: *mut u8, v: &[__m512i; UNROLL]) {
    for (u, &v) in v.iter().enumerate() {
        // SAFETY: u * 64 + 64 <= STEP_BYTES bytes at p are writable.
        unsafe { store(p.add(u * VECTOR_BYTES), v) };
    }
}

/// # Safety
/// 64 bytes at `p` are readable; the CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load(p: *const u8) -> __m512i {
    // SAFETY: per the contract; the unaligned load has no alignment requirement.
    unsafe { _mm512_loadu_si512(p.cast()) }
}

/// # Safety
/// 64 bytes at `p` are writable; the CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store(p: *mut u8, v: __m512i) {
    // SAFETY: per the contract; the unaligned store has no alignment requirement.
    unsafe { _mm512_storeu_si512(p.cast(), v) }
}

/// # Safety
/// The bytes of `p` selected by `mask` are readable; the CPU has AVX-512BW.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn load_masked(p: *const u8, mask: __mmask64) -> __m512i {
    // SAFETY: masked-off bytes are neither read nor able to fault (AVX-512 fault suppression).
    unsafe { _mm512_maskz_loadu_epi8(mask, p.cast()) }
}

/// # Safety
/// The bytes of `p` selected by `mask` are writable; the CPU has AVX-512BW.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn store_masked(p: *mut u8, mask: __mmask64, v: __m512i) {
    // SAFETY: masked-off bytes are not written and cannot fault (AVX-512 fault suppression).
    unsafe { _mm512_mask_storeu_epi8(p.cast(), mask, v) }
}
