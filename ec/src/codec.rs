//! The codec: encode, reconstruct, verify and parity deltas for one profile.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, RwLock};

use arrayvec::ArrayVec;

use crate::gf::{self, Matrix};
use crate::kernel::{Kernel, Prepared};
use crate::{Backend, Error, Profile, ShardSet, SHARD_COUNT_MAX};

/// Decode matrices kept per (sources, wanted) pattern. 6+2 has 28 two-erasure patterns; the
/// bound only matters for wide profiles. When full, the cache is emptied and refilled.
pub const DECODE_CACHE_ENTRIES_MAX: usize = 1024;

/// Scratch for [`Codec::verify`], on the stack: parity is recomputed this many bytes (shared by
/// the m rows) at a time.
const VERIFY_SCRATCH_BYTES: usize = 16 * 1024;
const _: () = assert!(VERIFY_SCRATCH_BYTES / SHARD_COUNT_MAX >= 64);

/// One shard slot of a stripe, for [`Codec::reconstruct`].
#[derive(Debug)]
pub enum Shard<'a> {
    /// Holds the stripe's bytes for this shard (read from a node).
    Present(&'a [u8]),
    /// Lost, and to be rebuilt into this buffer.
    Wanted(&'a mut [u8]),
    /// Lost, and not needed.
    Missing,
}

/// Reed-Solomon over GF(2^8) for one [`Profile`]: systematic, MDS, with the coding matrix of
/// reed-solomon-erasure 6.0 (shards interoperate with it byte for byte).
///
/// All methods take `&self` and may run on many threads at once; buffers are the caller's.
/// Every shard passed to one call has the same length, which may be any length (one stripe
/// unit, a part of one for partial updates, or several consecutive units of the same shards).
/// Shape mistakes (wrong counts, unequal lengths, bad indices) panic with a message.
pub struct Codec {
    profile: Profile,
    kernel: Kernel,
    /// (k + m) × k; rows 0..k are the identity.
    matrix: Matrix,
    /// Rows k.. of `matrix`.
    encode: Prepared,
    /// Per data shard j: m × 2 with both columns = column j of the parity rows, so that
    /// P += c·old + c·new in one pass.
    delta: Vec<Prepared>,
    decode_cache: RwLock<DecodeCache>,
}

type DecodeCache = HashMap<(ShardSet, ShardSet), Arc<Prepared>, BuildHasherDefault<PatternHasher>>;

/// The cache key is two bit masks that callers do not choose adversarially (they come from
/// which nodes answered), so a multiply-rotate hash replaces SipHash: a lookup is on the path of
/// every degraded read.
#[derive(Default)]
struct PatternHasher(u64);

impl Hasher for PatternHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(26) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl Codec {
    /// A codec on the fastest backend this CPU can run ([`Backend::best`]).
    pub fn new(profile: Profile) -> Codec {
        Codec::with_backend(profile, Backend::best())
            .expect("Backend::best only returns runnable backends")
    }

    /// A codec on a chosen backend; fails when this CPU lacks what the backend executes.
    pub fn with_backend(profile: Profile, backend: Backend) -> Result<Codec, Error> {
        let kernel = Kernel::new(backend)?;
        let (k, m) = (profile.k(), profile.m());
        let matrix = gf::coding_matrix(k, m);
        let parity = matrix.select_rows(k..k + m);
        let encode = kernel.prepare(&parity);
        let delta = (0..k)
            .map(|j| {
                let mut d = Matrix::zero(m, 2);
                for i in 0..m {
                    d.set(i, 0, parity.get(i, j));
                    d.set(i, 1, parity.get(i, j));
                }
                kernel.prepare(&d)
            })
            .collect();
        Ok(Codec {
            profile,
            kernel,
            matrix,
            encode,
            delta,
            decode_cache: RwLock::new(DecodeCache::default()),
        })
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    pub fn backend(&self) -> Backend {
        self.kernel.backend()
    }

    /// The coefficient of data shard `data` in parity shard `k + parity`.
    pub fn coefficient(&self, parity: usize, data: usize) -> u8 {
        assert!(parity < self.profile.m() && data < self.profile.k());
        self.matrix.get(self.profile.k() + parity, data)
    }

    /// Computes the m parity shards of k data shards into the caller's buffers. No allocation.
    ///
    /// # Panics
    /// If `data.len() != k`, `parity.len() != m`, or the lengths differ.
    pub fn encode(&self, data: &[&[u8]], parity: &mut [&mut [u8]]) {
        assert_eq!(data.len(), self.profile.k(), "encode takes k data shards");
        assert_eq!(
            parity.len(),
            self.profile.m(),
            "encode fills m parity shards"
        );
        self.kernel.apply(&self.encode, data, parity, false);
    }

    /// [`encode`](Codec::encode) of one stripe held contiguously, as it sits in the object:
    /// `stripe` is k consecutive shard-length pieces (data shard j = piece j).
    ///
    /// # Panics
    /// If `parity.len() != m` or `stripe.len() != k · parity[i].len()`.
    pub fn encode_stripe(&self, stripe: &[u8], parity: &mut [&mut [u8]]) {
        let k = self.profile.k();
        assert_eq!(
            parity.len(),
            self.profile.m(),
            "encode fills m parity shards"
        );
        let len = parity[0].len();
        assert_eq!(
            stripe.len(),
            k * len,
            "a stripe is k pieces of the parity length"
        );
        if len == 0 {
            return;
        }
        let data: ArrayVec<&[u8], SHARD_COUNT_MAX> = stripe.chunks_exact(len).collect();
        self.kernel.apply(&self.encode, &data, parity, false);
    }

    /// Rebuilds every [`Shard::Wanted`] slot from the [`Shard::Present`] ones: degraded reads
    /// (want the lost data shards) and recovery (want the shard being rebuilt on a new node)
    /// alike. Uses the first k present shards; only the wanted shards are computed. No
    /// allocation once the erasure pattern's decode matrix is cached.
    ///
    /// # Errors
    /// [`Error::TooFewShards`] when fewer than k shards are present.
    ///
    /// # Panics
    /// If `shards.len() != k + m` or the present and wanted buffers differ in length.
    pub fn reconstruct(&self, shards: &mut [Shard<'_>]) -> Result<(), Error> {
        let (k, n) = (self.profile.k(), self.profile.shard_count());
        assert_eq!(shards.len(), n, "reconstruct takes all k + m shard slots");
        // Gathered without initialising SHARD_COUNT_MAX slots: this is on every degraded read.
        let mut sources: ArrayVec<&[u8], SHARD_COUNT_MAX> = ArrayVec::new();
        let mut targets: ArrayVec<&mut [u8], SHARD_COUNT_MAX> = ArrayVec::new();
        let (mut used, mut wanted) = (ShardSet::EMPTY, ShardSet::EMPTY);
        let mut present = 0;
        let mut len = None;
        for (i, shard) in shards.iter_mut().enumerate() {
            let this = match shard {
                Shard::Present(buf) => Some(buf.len()),
                Shard::Wanted(buf) => Some(buf.len()),
                Shard::Missing => None,
            };
            if let Some(this) = this {
                assert_eq!(
                    *len.get_or_insert(this),
                    this,
                    "shard {i} differs in length"
                );
            }
            match shard {
                Shard::Present(buf) => {
                    if used.len() < k {
                        sources.push(buf);
                        used.insert(i);
                    }
                    present += 1;
                }
                Shard::Wanted(buf) => {
                    targets.push(buf);
                    wanted.insert(i);
                }
                Shard::Missing => {}
            }
        }
        if wanted.is_empty() {
            return Ok(());
        }
        if present < k {
            return Err(Error::TooFewShards { present, needed: k });
        }
        let (sources, targets) = (sources.as_slice(), targets.as_mut_slice());
        {
            // Hit: decode under the read guard (no reference count traffic); writers only
            // wait for it when a new pattern appears.
            let cache = self.decode_cache.read().unwrap_or_else(|e| e.into_inner());
            if let Some(plan) = cache.get(&(used, wanted)) {
                self.kernel.apply(plan, sources, targets, false);
                return Ok(());
            }
        }
        let plan = self.decode_plan(used, wanted);
        self.kernel.apply(&plan, sources, targets, false);
        Ok(())
    }

    /// Recomputes the parity of a full stripe (all k + m shards, in order) and returns the
    /// parity shards that disagree with it. An empty set means the stripe is consistent. A
    /// corrupt data shard shows up as (usually all) parity shards mismatching; which data
    /// shard is bad is for the per-shard checksums to say. No allocation.
    ///
    /// # Panics
    /// If `shards.len() != k + m` or the lengths differ.
    pub fn verify(&self, shards: &[&[u8]]) -> ShardSet {
        let (k, m) = (self.profile.k(), self.profile.m());
        assert_eq!(shards.len(), k + m, "verify takes all k + m shards");
        let len = shards[0].len();
        assert!(
            shards.iter().all(|s| s.len() == len),
            "shards differ in length"
        );
        let chunk = (VERIFY_SCRATCH_BYTES / m) & !63;
        let mut scratch = [0u8; VERIFY_SCRATCH_BYTES];
        let mut bad = ShardSet::EMPTY;
        let mut start = 0;
        while start < len {
            let end = (start + chunk).min(len);
            let data: ArrayVec<&[u8], SHARD_COUNT_MAX> =
                shards[..k].iter().map(|s| &s[start..end]).collect();
            let mut out: ArrayVec<&mut [u8], SHARD_COUNT_MAX> =
                scratch.chunks_exact_mut(end - start).take(m).collect();
            self.kernel.apply(&self.encode, &data, &mut out, false);
            for i in 0..m {
                if *out[i] != shards[k + i][start..end] {
                    bad.insert(k + i);
                }
            }
            start = end;
        }
        bad
    }

    /// Brings parity up to date after data shard `data_shard` changed from `old` to `new` over
    /// one range: `parity[i]` (the same range of parity shard k + i) becomes
    /// P_i + c_ij · (old + new) — addition is XOR in GF(2^8) — without reading the other data
    /// shards. The result is byte-identical to re-encoding the stripe. Call once per touched
    /// data shard. No allocation.
    ///
    /// # Panics
    /// If `data_shard >= k`, `parity.len() != m`, or the lengths differ.
    pub fn parity_delta(
        &self,
        data_shard: usize,
        old: &[u8],
        new: &[u8],
        parity: &mut [&mut [u8]],
    ) {
        assert!(
            data_shard < self.profile.k(),
            "{data_shard} is not a data shard"
        );
        assert_eq!(
            parity.len(),
            self.profile.m(),
            "parity_delta updates m parity ranges"
        );
        self.kernel
            .apply(&self.delta[data_shard], &[old, new], parity, true);
    }

    /// Erasure patterns whose decode matrices are cached.
    pub fn decode_cache_len(&self) -> usize {
        self.decode_cache
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The matrix taking the shards in `used` (k of them, ascending) to those in `wanted`.
    fn decode_plan(&self, used: ShardSet, wanted: ShardSet) -> Arc<Prepared> {
        let key = (used, wanted);
        if let Some(plan) = self
            .decode_cache
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return plan.clone();
        }
        let plan = Arc::new(self.kernel.prepare(&self.decode_matrix(used, wanted)));
        let mut cache = self.decode_cache.write().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= DECODE_CACHE_ENTRIES_MAX {
            cache.clear();
        }
        cache.insert(key, plan.clone());
        plan
    }

    fn decode_matrix(&self, used: ShardSet, wanted: ShardSet) -> Matrix {
        let k = self.profile.k();
        debug_assert_eq!(used.len(), k);
        // `sub` maps the data shards to the used shards; its inverse maps back.
        let sub = self.matrix.select_rows(used.iter());
        let inv = sub
            .invert()
            .expect("any k rows of the coding matrix are independent (MDS)");
        // Data shard w is row w of the inverse; any shard is its coding row times the inverse.
        self.matrix.select_rows(wanted.iter()).multiply(&inv)
    }
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Codec")
            .field("profile", &self.profile)
            .field("backend", &self.backend())
            .finish_non_exhaustive()
    }
}
