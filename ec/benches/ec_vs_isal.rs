//! `cargo bench -p nvstore-ec`: 6+2 encode and reconstruct-2-lost throughput of nvstore-ec,
//! side by side in the same run with Intel ISA-L (Debian's libisal 2.30, linked here and only
//! here) and reed-solomon-erasure 6.0 (`simd-accel`), at 4 KiB, 64 KiB and 1 MiB shards.
//!
//! Figures are GB/s (10^9 bytes) of data per core: k × shard bytes per second on one thread,
//! for encode (k data → m parity) and for reconstruct (k surviving shards → the 2 lost data
//! shards). Each round runs every implementation once per size; the table shows medians.
//!
//! * ISA-L uses its own Cauchy matrix (`gf_gen_cauchy1_matrix`) and its decode tables are built
//!   once outside the timing, which is the most favourable setup for it; nvstore-ec goes
//!   through its public API (decode matrices from its per-pattern cache).
//! * Before timing, ISA-L is also fed nvstore-ec's coding matrix and must produce the same
//!   parity bytes: the three implementations compute the same code.
//!
//! Environment: `NVSTORE_BENCH_ROUNDS` (default 7), `NVSTORE_EC_BENCH_MB` data per sample
//! (default 2048). Without `--bench` (plain `cargo test --benches`) one short round runs.

use std::hint::black_box;
use std::os::raw::c_int;
use std::time::Instant;

use nvstore_ec::{Backend, Codec, Profile, Shard};
use rand::{Rng, SeedableRng};

const K: usize = 6;
const M: usize = 2;
const SIZES: [usize; 3] = [4 << 10, 64 << 10, 1 << 20];
/// The two shards lost for reconstruct: both data shards, the costly case (degraded read).
const LOST: [usize; 2] = [0, 1];

#[link(name = "isal")]
extern "C" {
    fn gf_gen_cauchy1_matrix(a: *mut u8, m: c_int, k: c_int);
    fn gf_invert_matrix(input: *mut u8, output: *mut u8, n: c_int) -> c_int;
    fn ec_init_tables(k: c_int, rows: c_int, a: *mut u8, gftbls: *mut u8);
    fn ec_encode_data(
        len: c_int,
        k: c_int,
        rows: c_int,
        gftbls: *mut u8,
        data: *mut *mut u8,
        coding: *mut *mut u8,
    );
}

/// ISA-L with its tables prepared for one coding matrix (rows × k coefficients).
struct IsalTables {
    k: usize,
    rows: usize,
    tables: Vec<u8>,
}

impl IsalTables {
    fn new(k: usize, coefficients: &[u8]) -> IsalTables {
        let rows = coefficients.len() / k;
        assert_eq!(rows * k, coefficients.len());
        let mut a = coefficients.to_vec();
        let mut tables = vec![0u8; 32 * k * rows];
        // SAFETY: `a` holds rows × k bytes and `tables` the 32 × k × rows ISA-L documents.
        unsafe {
            ec_init_tables(
                k as c_int,
                rows as c_int,
                a.as_mut_ptr(),
                tables.as_mut_ptr(),
            )
        };
        IsalTables { k, rows, tables }
    }

    /// outputs = matrix · inputs.
    fn apply(&mut self, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) {
        assert_eq!((inputs.len(), outputs.len()), (self.k, self.rows));
        let len = inputs[0].len();
        assert!(inputs.iter().all(|s| s.len() == len) && outputs.iter().all(|s| s.len() == len));
        let mut ins = [std::ptr::null_mut::<u8>(); 16];
        let mut outs = [std::ptr::null_mut::<u8>(); 16];
        for (p, s) in ins.iter_mut().zip(inputs) {
            // ISA-L's prototype is not const-correct; it only reads the sources.
            *p = s.as_ptr().cast_mut();
        }
        for (p, s) in outs.iter_mut().zip(outputs.iter_mut()) {
            *p = s.as_mut_ptr();
        }
        // SAFETY: k source pointers readable and `rows` output pointers writable for `len`
        // bytes each; the tables were built by ec_init_tables for this k and rows.
        unsafe {
            ec_encode_data(
                len as c_int,
                self.k as c_int,
                self.rows as c_int,
                self.tables.as_mut_ptr(),
                ins.as_mut_ptr(),
                outs.as_mut_ptr(),
            )
        };
    }
}

/// ISA-L's own (k + m) × k Cauchy coding matrix.
fn isal_cauchy(k: usize, m: usize) -> Vec<u8> {
    let mut a = vec![0u8; (k + m) * k];
    // SAFETY: `a` holds (k + m) × k bytes.
    unsafe { gf_gen_cauchy1_matrix(a.as_mut_ptr(), (k + m) as c_int, k as c_int) };
    a
}

/// Rows of the inverse of the survivors' k × k submatrix that rebuild the lost data shards.
fn isal_decode_rows(encode: &[u8], k: usize, survivors: &[usize], lost: &[usize]) -> Vec<u8> {
    let mut sub: Vec<u8> = survivors
        .iter()
        .flat_map(|&r| encode[r * k..(r + 1) * k].iter().copied())
        .collect();
    let mut inv = vec![0u8; k * k];
    // SAFETY: both buffers hold k × k bytes.
    let rc = unsafe { gf_invert_matrix(sub.as_mut_ptr(), inv.as_mut_ptr(), k as c_int) };
    assert_eq!(rc, 0, "ISA-L: survivor matrix singular");
    lost.iter()
        .flat_map(|&d| inv[d * k..(d + 1) * k].iter().copied())
        .collect()
}

/// Shard buffers starting on 64-byte boundaries, as both libraries prefer.
struct Buffers {
    backing: Vec<Vec<u8>>,
    len: usize,
}

impl Buffers {
    fn new(count: usize, len: usize) -> Buffers {
        Buffers {
            backing: (0..count).map(|_| vec![0u8; len + 64]).collect(),
            len,
        }
    }
    fn get(&self, i: usize) -> &[u8] {
        let b = &self.backing[i];
        let off = b.as_ptr().align_offset(64);
        &b[off..off + self.len]
    }
    fn get_mut(&mut self, i: usize) -> &mut [u8] {
        let b = &mut self.backing[i];
        let off = b.as_ptr().align_offset(64);
        &mut b[off..off + self.len]
    }
    fn all(&self) -> Vec<&[u8]> {
        (0..self.backing.len()).map(|i| self.get(i)).collect()
    }
    /// Shards `range` mutably, the rest shared.
    fn split(&mut self, at: usize) -> (Vec<&[u8]>, Vec<&mut [u8]>) {
        let len = self.len;
        let (a, b) = self.backing.split_at_mut(at);
        let view = |v: &Vec<u8>| v.as_ptr().align_offset(64);
        let shared = a.iter().map(|v| &v[view(v)..view(v) + len]).collect();
        let mutable = b
            .iter_mut()
            .map(|v| {
                let off = view(v);
                &mut v[off..off + len]
            })
            .collect();
        (shared, mutable)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Encode,
    Reconstruct,
}

#[derive(Clone, Copy)]
enum Imp {
    Ours,
    Isal,
    Rse,
}

const IMPS: [Imp; 3] = [Imp::Ours, Imp::Isal, Imp::Rse];

/// Everything needed to run one implementation on one shard size.
struct Setup {
    len: usize,
    /// k data + m parity of nvstore-ec (= reed-solomon-erasure) code.
    stripe: Buffers,
    /// k data + m parity of ISA-L's Cauchy code.
    isal_stripe: Buffers,
    /// Output buffers for the lost shards.
    out: Buffers,
    /// Scratch stripe for reed-solomon-erasure's in-place reconstruct.
    rse_stripe: Buffers,
    codec: Codec,
    rse: reed_solomon_erasure::galois_8::ReedSolomon,
    isal_encode: IsalTables,
    isal_decode: IsalTables,
}

impl Setup {
    fn new(len: usize, codec: &Codec) -> Setup {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(len as u64);
        let mut stripe = Buffers::new(K + M, len);
        for i in 0..K {
            rng.fill(stripe.get_mut(i));
        }
        let codec = Codec::with_backend(*codec.profile(), codec.backend()).unwrap();
        {
            let (data, mut parity) = stripe.split(K);
            codec.encode(&data, &mut parity);
        }
        let mut isal_stripe = Buffers::new(K + M, len);
        for i in 0..K {
            isal_stripe.get_mut(i).copy_from_slice(stripe.get(i));
        }
        let cauchy = isal_cauchy(K, M);
        let mut isal_encode = IsalTables::new(K, &cauchy[K * K..]);
        {
            let (data, mut parity) = isal_stripe.split(K);
            isal_encode.apply(&data, &mut parity);
        }
        let survivors: Vec<usize> = (0..K + M).filter(|i| !LOST.contains(i)).collect();
        let isal_decode = IsalTables::new(K, &isal_decode_rows(&cauchy, K, &survivors, &LOST));
        let mut rse_stripe = Buffers::new(K + M, len);
        for i in 0..K + M {
            rse_stripe.get_mut(i).copy_from_slice(stripe.get(i));
        }
        Setup {
            len,
            stripe,
            isal_stripe,
            out: Buffers::new(M, len),
            rse_stripe,
            codec,
            rse: reed_solomon_erasure::galois_8::ReedSolomon::new(K, M).unwrap(),
            isal_encode,
            isal_decode,
        }
    }

    fn run(&mut self, imp: Imp, op: Op) {
        match (imp, op) {
            (Imp::Ours, Op::Encode) => {
                let data: Vec<&[u8]> = (0..K).map(|i| self.stripe.get(i)).collect();
                let (_, mut parity) = self.out.split(0);
                self.codec.encode(black_box(&data), &mut parity);
            }
            (Imp::Ours, Op::Reconstruct) => {
                let all = self.stripe.all();
                let (_, mut outs) = self.out.split(0);
                let mut outs = outs.iter_mut();
                let mut shards: [Shard<'_>; K + M] = std::array::from_fn(|i| {
                    if LOST.contains(&i) {
                        Shard::Wanted(outs.next().unwrap())
                    } else {
                        Shard::Present(all[i])
                    }
                });
                self.codec.reconstruct(black_box(&mut shards)).unwrap();
            }
            (Imp::Isal, Op::Encode) => {
                let data: Vec<&[u8]> = (0..K).map(|i| self.isal_stripe.get(i)).collect();
                let (_, mut parity) = self.out.split(0);
                self.isal_encode.apply(black_box(&data), &mut parity);
            }
            (Imp::Isal, Op::Reconstruct) => {
                let src: Vec<&[u8]> = (0..K + M)
                    .filter(|i| !LOST.contains(i))
                    .map(|i| self.isal_stripe.get(i))
                    .collect();
                let (_, mut outs) = self.out.split(0);
                self.isal_decode.apply(black_box(&src), &mut outs);
            }
            (Imp::Rse, Op::Encode) => {
                let data: Vec<&[u8]> = (0..K).map(|i| self.stripe.get(i)).collect();
                let (_, mut parity) = self.out.split(0);
                self.rse.encode_sep(black_box(&data), &mut parity).unwrap();
            }
            (Imp::Rse, Op::Reconstruct) => {
                let (_, all) = self.rse_stripe.split(0);
                let mut shards: Vec<(&mut [u8], bool)> = all
                    .into_iter()
                    .enumerate()
                    .map(|(i, s)| (s, !LOST.contains(&i)))
                    .collect();
                self.rse.reconstruct_data(black_box(&mut shards)).unwrap();
            }
        }
    }

    /// Checks the last run of `imp`/`op` produced the right bytes.
    fn check(&self, imp: Imp, op: Op) {
        let (stripe, name) = match imp {
            Imp::Ours => (&self.stripe, "nvstore-ec"),
            Imp::Isal => (&self.isal_stripe, "ISA-L"),
            Imp::Rse => (&self.stripe, "reed-solomon-erasure"),
        };
        for (o, want) in (0..M).zip(match op {
            Op::Encode => [K, K + 1],
            Op::Reconstruct => LOST,
        }) {
            let got = match (imp, op) {
                (Imp::Rse, Op::Reconstruct) => self.rse_stripe.get(want),
                _ => self.out.get(o),
            };
            assert!(
                got == stripe.get(want),
                "{name}: wrong bytes for shard {want}"
            );
        }
    }

    /// Data GB/s of `iters` back-to-back runs.
    fn measure(&mut self, imp: Imp, op: Op, iters: usize) -> f64 {
        self.run(imp, op);
        self.check(imp, op);
        let start = Instant::now();
        for _ in 0..iters {
            self.run(imp, op);
        }
        let secs = start.elapsed().as_secs_f64();
        self.check(imp, op);
        (K * self.len * iters) as f64 / secs / 1e9
    }
}

/// ISA-L given nvstore-ec's coding matrix computes nvstore-ec's parity: same field, same code.
fn cross_check_with_isal(codec: &Codec) {
    let len = 1000;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut stripe = Buffers::new(K + M, len);
    for i in 0..K {
        rng.fill(stripe.get_mut(i));
    }
    let (data, mut parity) = stripe.split(K);
    codec.encode(&data, &mut parity);
    let coefficients: Vec<u8> = (0..M)
        .flat_map(|i| (0..K).map(move |j| (i, j)))
        .map(|(i, j)| codec.coefficient(i, j))
        .collect();
    let mut isal = IsalTables::new(K, &coefficients);
    let mut isal_parity = Buffers::new(M, len);
    let (_, mut p) = isal_parity.split(0);
    isal.apply(&data, &mut p);
    for i in 0..M {
        assert!(
            p[i] == parity[i],
            "ISA-L with our matrix disagrees on parity {i}"
        );
    }
}

/// The middle sample, or the mean of the two middle ones of an even count.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn size_label(len: usize) -> String {
    if len >= 1 << 20 {
        format!("{} MiB", len >> 20)
    } else {
        format!("{} KiB", len >> 10)
    }
}

fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let rounds = env_usize("NVSTORE_BENCH_ROUNDS", if quick { 1 } else { 7 }).max(1);
    let volume = env_usize("NVSTORE_EC_BENCH_MB", if quick { 32 } else { 2048 }) << 20;
    let codec = Codec::new(Profile::default());
    if !Backend::RseSimd.missing_features().is_empty() {
        eprintln!(
            "reed-solomon-erasure's C kernel cannot run on this CPU (lacks {:?}); not benchmarking",
            Backend::RseSimd.missing_features()
        );
        return;
    }
    cross_check_with_isal(&codec);
    if cfg!(debug_assertions) {
        println!("(unoptimised build: a smoke run of the harness, not a measurement)");
    }
    println!(
        "{K}+{M}, one thread, GB/s of data (k × shard bytes / s), median of {rounds} rounds, \
         {} MiB of data per sample",
        volume >> 20
    );
    println!(
        "nvstore-ec backend: {}; ISA-L: Debian libisal (ec_encode_data); \
         reed-solomon-erasure 6.0 simd-accel",
        codec.backend()
    );
    let mut setups: Vec<Setup> = SIZES.iter().map(|&s| Setup::new(s, &codec)).collect();
    // samples[op][size][imp]
    let mut samples = vec![vec![vec![Vec::new(); IMPS.len()]; SIZES.len()]; 2];
    for _ in 0..rounds {
        for (oi, op) in [Op::Encode, Op::Reconstruct].into_iter().enumerate() {
            for (si, setup) in setups.iter_mut().enumerate() {
                let iters = (volume / (K * setup.len)).max(1);
                for (ii, imp) in IMPS.into_iter().enumerate() {
                    samples[oi][si][ii].push(setup.measure(imp, op, iters));
                }
            }
        }
    }
    println!(
        "\n{:<12} {:>8} {:>8} {:>8} {:>8} {:>11} {:>9}",
        "op", "shard", "ours", "ISA-L", "RSE", "ours/ISA-L", "ours/RSE"
    );
    for (oi, name) in ["encode", "reconstruct"].into_iter().enumerate() {
        for (si, &len) in SIZES.iter().enumerate() {
            let [ours, isal, rse] = [0, 1, 2].map(|ii| median(&mut samples[oi][si][ii]));
            println!(
                "{:<12} {:>8} {:>8.1} {:>8.1} {:>8.1} {:>10.2}× {:>8.2}×",
                name,
                size_label(len),
                ours,
                isal,
                rse,
                ours / isal,
                ours / rse
            );
        }
    }
    println!(
        "\nreconstruct = rebuild data shards {LOST:?} from the other {K}; \
         ISA-L decode tables precomputed"
    );
    println!("peak RSS: {} MiB", peak_rss_kib() / 1024);
}
