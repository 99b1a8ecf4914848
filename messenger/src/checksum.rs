//! CRC-32C (Castagnoli), the checksum of every frame header and payload.
//!
//! Computed with `crc-fast`, which folds with VPCLMULQDQ/AVX-512 where the CPU has it (about
//! 2.5× the `crc32` instruction loop of the `crc32c` crate on large buffers here), so checking a
//! 4 MiB payload costs a fraction of copying it through the socket. Values are identical to
//! `crc32c::crc32c` (tested below).

/// CRC-32C of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// Continue a CRC-32C: `crc32c_append(crc32c(a), b) == crc32c(a ‖ b)`, and
/// `crc32c_append(0, b) == crc32c(b)`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    let mut d =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(data);
    d.finalize() as u32
}

/// CRC-32C of `a ‖ b` from `crc_a = crc32c(a)`, `crc_b = crc32c(b)` and `b`'s length, without
/// reading either (a reply that reuses a region whose crc is known, a shard read whose chunk
/// crcs the store verified).
///
/// Appending `b` multiplies `a`'s register by x^(8·len_b) mod P and adds `b`'s own crc (the
/// pre- and post-inversions cancel). The power comes from a table of x^(2^k) mod P, one
/// multiplication per set bit of the length: about 0.1 µs. The crates we use combine by
/// squaring 32×32 GF(2) matrices per bit of the length (zlib's old method), which measured
/// 10–17 µs: more than summing 64 KiB, so a per-chunk combine would cost more than it saves.
#[inline]
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: usize) -> u32 {
    mul_mod_p(x8n_mod_p(len_b as u64), crc_a) ^ crc_b
}

/// CRC-32C's polynomial, bit-reflected (bit 31 is the coefficient of x^0).
const POLY: u32 = 0x82F6_3B78;

/// a·b mod P, both reflected.
const fn mul_mod_p(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = 1u32 << 31;
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        // b ← b·x mod P
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        bit >>= 1;
    }
    product
}

/// `X2N[k]` = x^(2^k) mod P.
const X2N: [u32; 64] = {
    let mut t = [0u32; 64];
    let mut p = 1u32 << 30; // x^1
    let mut k = 0;
    while k < 64 {
        t[k] = p;
        p = mul_mod_p(p, p);
        k += 1;
    }
    t
};

/// x^(8·n) mod P: the operator that appends n zero bytes to a CRC register.
fn x8n_mod_p(mut n: u64) -> u32 {
    let mut p = 1u32 << 31; // x^0
    let mut k = 3; // 8·n = n·2^3
    while n != 0 {
        if n & 1 != 0 {
            p = mul_mod_p(X2N[k], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn check_value() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    proptest! {
        #[test]
        fn matches_the_crc32c_crate_whole_and_appended(data in proptest::collection::vec(any::<u8>(), 0..5000), cut in 0usize..5000) {
            let cut = cut.min(data.len());
            prop_assert_eq!(crc32c(&data), ::crc32c::crc32c(&data));
            prop_assert_eq!(crc32c_append(crc32c(&data[..cut]), &data[cut..]), crc32c(&data));
            prop_assert_eq!(crc32c_append(0, &data), crc32c(&data));
            prop_assert_eq!(
                crc32c_combine(crc32c(&data[..cut]), crc32c(&data[cut..]), data.len() - cut),
                crc32c(&data)
            );
        }

        /// Large lengths (a 64 GiB tail, never summed here) against crc-fast's matrix combine.
        #[test]
        fn combine_matches_the_matrix_method_at_any_length(a: u32, b: u32, len in 0u64..(1 << 36)) {
            let want = crc_fast::checksum_combine(
                crc_fast::CrcAlgorithm::Crc32Iscsi,
                u64::from(a),
                u64::from(b),
                len,
            ) as u32;
            prop_assert_eq!(crc32c_combine(a, b, len as usize), want);
        }
    }
}
