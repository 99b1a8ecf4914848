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
/// reading either (a reply that reuses a region whose crc is known).
#[inline]
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: usize) -> u32 {
    crc_fast::checksum_combine(
        crc_fast::CrcAlgorithm::Crc32Iscsi,
        u64::from(crc_a),
        u64::from(crc_b),
        len_b as u64,
    ) as u32
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
    }
}
