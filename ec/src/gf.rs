//! GF(2^8) arithmetic on small matrices: the coding matrix, decode matrices, GFNI bit matrices.
//!
//! The field is reed-solomon-erasure's: GF(2^8) modulo x^8 + x^4 + x^3 + x^2 + 1 (0x11D),
//! scalar operations taken from `reed_solomon_erasure::galois_8` so both crates agree by
//! construction. Only matrices (at most `SHARD_COUNT_MAX` squared bytes) are computed here;
//! bulk data goes through `kernel`.

use reed_solomon_erasure::galois_8;

/// a · b in GF(2^8).
pub(crate) fn mul(a: u8, b: u8) -> u8 {
    galois_8::mul(a, b)
}

/// a / b in GF(2^8); `b` is non-zero.
fn div(a: u8, b: u8) -> u8 {
    assert!(b != 0, "GF(2^8) division by zero");
    galois_8::div(a, b)
}

/// A dense row-major matrix over GF(2^8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Matrix {
    rows: usize,
    cols: usize,
    cells: Vec<u8>,
}

impl Matrix {
    pub(crate) fn zero(rows: usize, cols: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            cells: vec![0; rows * cols],
        }
    }

    pub(crate) fn identity(n: usize) -> Matrix {
        let mut m = Matrix::zero(n, n);
        for i in 0..n {
            m.set(i, i, 1);
        }
        m
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    pub(crate) fn get(&self, r: usize, c: usize) -> u8 {
        assert!(r < self.rows && c < self.cols);
        self.cells[r * self.cols + c]
    }

    pub(crate) fn set(&mut self, r: usize, c: usize, v: u8) {
        assert!(r < self.rows && c < self.cols);
        self.cells[r * self.cols + c] = v;
    }

    pub(crate) fn row(&self, r: usize) -> &[u8] {
        &self.cells[r * self.cols..(r + 1) * self.cols]
    }

    /// The matrix made of the given rows of `self`, in the given order.
    pub(crate) fn select_rows(&self, rows: impl IntoIterator<Item = usize>) -> Matrix {
        let mut cells = Vec::new();
        let mut n = 0;
        for r in rows {
            cells.extend_from_slice(self.row(r));
            n += 1;
        }
        Matrix {
            rows: n,
            cols: self.cols,
            cells,
        }
    }

    pub(crate) fn multiply(&self, rhs: &Matrix) -> Matrix {
        assert_eq!(self.cols, rhs.rows, "matrix shapes do not chain");
        let mut out = Matrix::zero(self.rows, rhs.cols);
        for r in 0..self.rows {
            for c in 0..rhs.cols {
                let mut acc = 0u8;
                for i in 0..self.cols {
                    acc ^= mul(self.get(r, i), rhs.get(i, c));
                }
                out.set(r, c, acc);
            }
        }
        out
    }

    /// The inverse by Gauss-Jordan elimination; `None` when singular.
    pub(crate) fn invert(&self) -> Option<Matrix> {
        assert_eq!(self.rows, self.cols, "only square matrices invert");
        let n = self.rows;
        let mut a = self.clone();
        let mut inv = Matrix::identity(n);
        for col in 0..n {
            let pivot = (col..n).find(|&r| a.get(r, col) != 0)?;
            a.swap_rows(col, pivot);
            inv.swap_rows(col, pivot);
            let scale = div(1, a.get(col, col));
            a.scale_row(col, scale);
            inv.scale_row(col, scale);
            for r in 0..n {
                let factor = a.get(r, col);
                if r != col && factor != 0 {
                    a.add_scaled_row(r, col, factor);
                    inv.add_scaled_row(r, col, factor);
                }
            }
        }
        Some(inv)
    }

    fn swap_rows(&mut self, a: usize, b: usize) {
        if a != b {
            for c in 0..self.cols {
                self.cells.swap(a * self.cols + c, b * self.cols + c);
            }
        }
    }

    fn scale_row(&mut self, r: usize, s: u8) {
        for c in 0..self.cols {
            let v = self.get(r, c);
            self.set(r, c, mul(v, s));
        }
    }

    /// row[dst] += factor · row[src]
    fn add_scaled_row(&mut self, dst: usize, src: usize, factor: u8) {
        for c in 0..self.cols {
            let v = self.get(dst, c) ^ mul(factor, self.get(src, c));
            self.set(dst, c, v);
        }
    }
}

/// The systematic (k + m) × k coding matrix, built exactly as reed-solomon-erasure 6.0 builds
/// it: the Vandermonde matrix V[r][c] = r^c (with 0^0 = 1) times the inverse of its top k × k
/// square. The top k rows are the identity; rows k.. are the parity coefficients.
///
/// This is the contract with shards already on disk: changing it changes every parity byte.
/// The known-answer vectors under `tests/vectors/` pin it.
pub(crate) fn coding_matrix(k: usize, m: usize) -> Matrix {
    let n = k + m;
    assert!(n <= 256, "GF(2^8) has 256 distinct evaluation points");
    let mut vandermonde = Matrix::zero(n, k);
    for r in 0..n {
        for c in 0..k {
            vandermonde.set(r, c, galois_8::exp(r as u8, c));
        }
    }
    let top = vandermonde.select_rows(0..k);
    let top_inv = top
        .invert()
        .expect("a square Vandermonde matrix on distinct points is invertible");
    vandermonde.multiply(&top_inv)
}

/// The 8×8 bit matrix A (as `vgf2p8affineqb` reads it) with A·x = c·x in this field.
///
/// `vgf2p8affineqb` computes output bit i of each byte as the parity of (x AND byte 7−i of the
/// qword). Multiplication by a constant is linear over GF(2): output bit i of c·x is the XOR of
/// the input bits j for which bit i of c·2^j is set. So byte 7−i holds those j as a bit mask.
pub(crate) fn gfni_matrix(c: u8) -> u64 {
    let mut qword = 0u64;
    for i in 0..8 {
        let mut row = 0u8;
        for j in 0..8 {
            if mul(c, 1 << j) & (1 << i) != 0 {
                row |= 1 << j;
            }
        }
        qword |= u64::from(row) << (8 * (7 - i));
    }
    qword
}

/// The 256-entry product table x ↦ c·x used by the portable kernel.
pub(crate) fn mul_table(c: u8) -> [u8; 256] {
    let mut t = [0u8; 256];
    for (x, slot) in t.iter_mut().enumerate() {
        *slot = mul(c, x as u8);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Applies an 8×8 bit matrix the way `vgf2p8affineqb` does (with b = 0), in plain Rust.
    fn affine_reference(a: u64, x: u8) -> u8 {
        let mut out = 0u8;
        for i in 0..8 {
            let row = (a >> (8 * (7 - i))) as u8;
            if (row & x).count_ones() % 2 == 1 {
                out |= 1 << i;
            }
        }
        out
    }

    #[test]
    fn gfni_matrix_multiplies_for_every_pair() {
        for c in 0..=255u8 {
            let a = gfni_matrix(c);
            for x in 0..=255u8 {
                assert_eq!(affine_reference(a, x), mul(c, x), "c={c} x={x}");
            }
        }
    }

    #[test]
    fn field_is_0x11d() {
        // 2 · 0x80 = x^8 = x^4 + x^3 + x^2 + 1 = 0x1D.
        assert_eq!(mul(2, 0x80), 0x1D);
        assert_eq!(mul(1, 0xA7), 0xA7);
        assert_eq!(mul(0, 0xA7), 0);
    }

    #[test]
    fn coding_matrix_is_systematic_and_mds_for_6_2() {
        let (k, m) = (6, 2);
        let g = coding_matrix(k, m);
        assert_eq!(g.select_rows(0..k), Matrix::identity(k));
        // Every k-subset of rows is invertible (MDS).
        for lost_a in 0..k + m {
            for lost_b in lost_a + 1..k + m {
                let rows = (0..k + m).filter(|&r| r != lost_a && r != lost_b);
                assert!(g.select_rows(rows).invert().is_some(), "{lost_a},{lost_b}");
            }
        }
    }

    #[test]
    fn invert_round_trips() {
        let g = coding_matrix(4, 3);
        let sub = g.select_rows([1, 4, 5, 6]);
        let inv = sub.invert().expect("MDS");
        assert_eq!(sub.multiply(&inv), Matrix::identity(4));
        assert_eq!(inv.multiply(&sub), Matrix::identity(4));
    }

    #[test]
    fn singular_matrix_does_not_invert() {
        let mut s = Matrix::identity(3);
        s.set(2, 2, 0);
        assert!(s.invert().is_none());
    }
}
