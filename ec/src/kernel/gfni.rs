//! The AVX-512 + GFNI multiply-accumulate kernel.
//!
//! Multiplying a byte by a constant c in GF(2^8) is a linear map over GF(2), so it is an 8×8
//! bit matrix A_c (see `gf::gfni_matrix`), and `vgf2p8affineqb` applies one to 64 bytes at once
//! whatever the field polynomial (unlike `vgf2p8mulb`, which is fixed to 0x11B). An output row
//! is the XOR over the inputs of affine(input_j, A_ij): one instruction and one XOR per input
//! per output per 64 bytes, with each input vector loaded once for up to `GROUP_MAX` outputs.
//! ISA-L's AVX-512 kernel needs two `vpshufb`, a shift, two ANDs and two XORs for the same.
//!
//! Tails shorter than 64 bytes use masked loads and stores, which do not touch (or fault on)
//! the masked-off bytes, so there is no scalar tail loop.

use core::arch::x86_64::{
    __m512i, __mmask64, _mm512_gf2p8affine_epi64_epi8, _mm512_loadu_si512,
    _mm512_mask_storeu_epi8, _mm512_maskz_loadu_epi8, _mm512_set1_epi64, _mm512_setzero_si512,
    _mm512_storeu_si512, _mm512_xor_si512,
};

use crate::SHARD_COUNT_MAX;

/// Outputs computed per pass over the inputs: 4 outputs × 2 vectors of accumulators, plus two
/// input vectors and the broadcast matrices, stay within the 32 zmm registers.
const GROUP_MAX: usize = 4;

/// When more than `GROUP_MAX` outputs need several passes, the data is walked in blocks of this
/// many bytes so each pass after the first reads its inputs from L1/L2 rather than memory.
const BLOCK_BYTES: usize = 16 * 1024;

const VECTOR_BYTES: usize = 64;

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

/// G output rows over `len` bytes: two vectors per step, then single (masked) vectors.
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
    while off + 2 * VECTOR_BYTES <= len {
        let mut acc0 = [_mm512_setzero_si512(); G];
        let mut acc1 = [_mm512_setzero_si512(); G];
        if ACC {
            for g in 0..G {
                // SAFETY: off + 128 <= len, and outs[g] is readable for len bytes.
                unsafe {
                    acc0[g] = load(outs[g].add(off));
                    acc1[g] = load(outs[g].add(off + VECTOR_BYTES));
                }
            }
        }
        for c in 0..cols {
            // SAFETY: c < cols = ins.len(); off + 128 <= len and ins[c] is readable for len.
            let (x0, x1) = unsafe {
                let p = (*ins.get_unchecked(c)).add(off);
                (load(p), load(p.add(VECTOR_BYTES)))
            };
            for g in 0..G {
                // SAFETY: g * cols + c < G * cols = mats.len().
                let a = _mm512_set1_epi64(unsafe { *mats.get_unchecked(g * cols + c) } as i64);
                acc0[g] = _mm512_xor_si512(acc0[g], _mm512_gf2p8affine_epi64_epi8::<0>(x0, a));
                acc1[g] = _mm512_xor_si512(acc1[g], _mm512_gf2p8affine_epi64_epi8::<0>(x1, a));
            }
        }
        for g in 0..G {
            // SAFETY: off + 128 <= len, and outs[g] is writable for len bytes.
            unsafe {
                store(outs[g].add(off), acc0[g]);
                store(outs[g].add(off + VECTOR_BYTES), acc1[g]);
            }
        }
        off += 2 * VECTOR_BYTES;
    }
    while off < len {
        let n = (len - off).min(VECTOR_BYTES);
        let mask: __mmask64 = u64::MAX >> (VECTOR_BYTES - n);
        let mut acc = [_mm512_setzero_si512(); G];
        if ACC {
            for g in 0..G {
                // SAFETY: the mask covers only bytes off..off + n <= len of outs[g].
                acc[g] = unsafe { load_masked(outs[g].add(off), mask) };
            }
        }
        for c in 0..cols {
            // SAFETY: c < ins.len(); the mask covers only bytes off..off + n <= len of ins[c].
            let x = unsafe { load_masked((*ins.get_unchecked(c)).add(off), mask) };
            for g in 0..G {
                // SAFETY: g * cols + c < G * cols = mats.len().
                let a = _mm512_set1_epi64(unsafe { *mats.get_unchecked(g * cols + c) } as i64);
                acc[g] = _mm512_xor_si512(acc[g], _mm512_gf2p8affine_epi64_epi8::<0>(x, a));
            }
        }
        for g in 0..G {
            // SAFETY: the mask covers only bytes off..off + n <= len of outs[g].
            unsafe { store_masked(outs[g].add(off), mask, acc[g]) };
        }
        off += n;
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
