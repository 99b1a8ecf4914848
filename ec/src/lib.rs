//! nvstore's erasure coding: an object becomes k data + m parity shards per stripe, and any k
//! of the k + m shards give it back. Default profile 6+2 with a 64 KiB stripe unit. No IO here:
//! callers own every buffer and pass slices.
//!
//! * [`Profile`] — k, m, stripe unit; and the layout math ([`Profile::locate`],
//!   [`Profile::extents`], [`Profile::shard_size`], padding; see [`layout`]).
//! * [`Codec`] — [`encode`](Codec::encode) into caller buffers,
//!   [`reconstruct`](Codec::reconstruct) any wanted shards from any k present ones (degraded
//!   reads and recovery), [`verify`](Codec::verify) a stripe,
//!   [`parity_delta`](Codec::parity_delta) for partial-stripe overwrites. Decode matrices are
//!   cached per erasure pattern.
//!
//! ```
//! use nvstore_ec::{Codec, Profile, Shard};
//!
//! let codec = Codec::new(Profile::default()); // 6+2
//! let data: Vec<Vec<u8>> = (0..6u8).map(|j| vec![j; 4096]).collect();
//! let mut parity = vec![vec![0u8; 4096]; 2];
//! let data_refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
//! let mut parity_refs: Vec<&mut [u8]> = parity.iter_mut().map(|p| p.as_mut_slice()).collect();
//! codec.encode(&data_refs, &mut parity_refs);
//!
//! // Lose data shards 1 and 4; rebuild them from the other six.
//! let (mut one, mut four) = (vec![0u8; 4096], vec![0u8; 4096]);
//! let mut shards = [
//!     Shard::Present(&data[0]),
//!     Shard::Wanted(&mut one),
//!     Shard::Present(&data[2]),
//!     Shard::Present(&data[3]),
//!     Shard::Wanted(&mut four),
//!     Shard::Present(&data[5]),
//!     Shard::Present(&parity[0]),
//!     Shard::Present(&parity[1]),
//! ];
//! codec.reconstruct(&mut shards).unwrap();
//! assert_eq!((one, four), (data[1].clone(), data[4].clone()));
//! ```
//!
//! # The code
//!
//! Reed-Solomon over GF(2^8) modulo 0x11D with reed-solomon-erasure 6.0's systematic matrix
//! (Vandermonde times the inverse of its top square), so shards are interchangeable with that
//! crate's; the committed vectors in `tests/vectors/` pin every parity byte across versions.
//!
//! # What a build requires of the CPU
//!
//! Nothing beyond the target's baseline: every faster path is chosen at run time, after
//! checking the CPU, so no path can die with SIGILL. See [`Backend`]:
//!
//! * [`Backend::Gfni`] (x86_64 with AVX-512F, AVX-512BW and GFNI: Intel Ice Lake and later,
//!   AMD Zen 4 and later) — this crate's `vgf2p8affineqb` kernel, the fastest.
//! * [`Backend::RseSimd`] — reed-solomon-erasure's `simd-accel` C kernel. Its build script
//!   compiles that C with `-march=haswell` on x86_64 (or `-march=$RUST_REED_SOLOMON_ERASURE_ARCH`
//!   when set), with no runtime dispatch inside, so the compiled object may use any Haswell
//!   instruction (AVX2, FMA, BMI1/2, LZCNT, MOVBE, F16C, ...). This crate's build script
//!   records that `-march` and the backend is only used when `is_x86_feature_detected!` finds
//!   every feature it implies (an unrecognised `-march` such as `native` disables it).
//! * [`Backend::Portable`] — table lookups in safe Rust, on any CPU.
//!
//! [`Codec::new`] takes the fastest available; [`Codec::with_backend`] returns
//! [`Error::BackendUnavailable`] naming the missing features instead of running it.

pub mod codec;
mod error;
mod gf;
mod kernel;
pub mod layout;
pub mod profile;
mod shard_set;

pub use codec::{Codec, Shard, DECODE_CACHE_ENTRIES_MAX};
pub use error::Error;
pub use kernel::Backend;
pub use layout::{Extent, Extents, Location, UpdateMethod};
pub use profile::Profile;
pub use shard_set::ShardSet;

/// Most shards (k + m) in one stripe.
pub const SHARD_COUNT_MAX: usize = 64;

/// The `-march` reed-solomon-erasure's C kernel was built with (empty: its default,
/// `haswell` on x86_64), and the CPU features it implies (`None`: not checkable).
pub fn rse_build_requirements() -> (&'static str, Option<&'static [&'static str]>) {
    (kernel::rse::MARCH, kernel::rse::required_features())
}
