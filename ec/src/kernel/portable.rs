//! The portable kernel: one 256-byte product table per coefficient, one byte at a time.
//!
//! Plain safe Rust with no CPU requirement beyond the target's baseline: the safe path on CPUs
//! where neither the GFNI kernel nor reed-solomon-erasure's C kernel may run.

/// Outputs are built in blocks of this many bytes so they stay in L1 across all inputs.
const BLOCK_BYTES: usize = 4 * 1024;

/// outputs[r] (=|^=) Σ_c tables[r * cols + c][inputs[c]].
pub(super) fn apply(
    tables: &[[u8; 256]],
    inputs: &[&[u8]],
    outputs: &mut [&mut [u8]],
    accumulate: bool,
) {
    let cols = inputs.len();
    let len = inputs.first().map_or(0, |s| s.len());
    let mut start = 0;
    while start < len {
        let end = (start + BLOCK_BYTES).min(len);
        for (r, out) in outputs.iter_mut().enumerate() {
            let out = &mut out[start..end];
            if !accumulate {
                out.fill(0);
            }
            for (c, input) in inputs.iter().enumerate() {
                let table = &tables[r * cols + c];
                for (o, &x) in out.iter_mut().zip(&input[start..end]) {
                    *o ^= table[usize::from(x)];
                }
            }
        }
        start = end;
    }
}
