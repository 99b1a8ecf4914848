//! Client-side erasure coding of whole-object writes (`Client::put_shared` of objects of
//! [`CLIENT_EC_BYTES_MIN`] or more): the client encodes the object with its pool's codec,
//! stages shard s on member s (`MSG_CLIENT_STAGE_SHARD`), and sends the primary a
//! `WriteStaged` op naming the upload. The primary orders and versions the write as any other
//! and has the members write their staged shards (`node::staging`). Over the network go the
//! shards only (4/3 of the object for 6+2), not the object to the primary and the shards
//! again from it (7/3).
//!
//! The shards are laid out exactly as the primary lays out a whole object
//! (`node::primary::encode_full`; a test holds them equal): data shard j is the object's
//! stripe units j, j + k, j + 2k, … sent where they lie in the caller's buffer, parity is
//! encoded stripe by stripe into new buffers, and every slot is clipped to its meaningful
//! bytes. Each unit goes out with its CRC-32C, computed once here: the frame CRC is combined
//! from them, and the member's store records them as its chunks' CRCs.

use std::sync::Arc;

use ec::{Codec, Profile};
use messenger::checksum::{crc32c, crc32c_combine};
use messenger::RawBytes;

/// Whole-object writes of at least this many bytes are encoded by the client. Below it the
/// extra round trip (stage, then the op) costs more than the bytes it saves.
pub const CLIENT_EC_BYTES_MIN: usize = 1 << 20;

/// A piece of a shard in a shared buffer, with its CRC-32C.
#[derive(Clone)]
pub struct SharedUnit {
    buf: Arc<[u8]>,
    at: usize,
    len: usize,
    pub crc: u32,
}

impl SharedUnit {
    fn new(buf: Arc<[u8]>, at: usize, len: usize) -> SharedUnit {
        let crc = crc32c(&buf[at..at + len]);
        SharedUnit { buf, at, len, crc }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.at..self.at + self.len]
    }
}

// SAFETY: the region is a range of an `Arc<[u8]>` this value keeps alive; an `Arc<[u8]>`'s
// bytes are immutable while any clone of it lives.
unsafe impl RawBytes for SharedUnit {
    fn raw(&self) -> (*const u8, usize) {
        (self.bytes().as_ptr(), self.len)
    }

    fn crc32c_append(&self, crc: u32) -> u32 {
        crc32c_combine(crc, self.crc, self.len)
    }
}

/// Every slot's shard of the whole object `data`, as pieces of one stripe unit (the last one
/// of a slot shorter), clipped to the slot's meaningful bytes. `data` must not be empty.
pub fn encode_object(profile: &Profile, codec: &Codec, data: &Arc<[u8]>) -> Vec<Vec<SharedUnit>> {
    let (k, n, u) = (
        profile.k(),
        profile.k() + profile.m(),
        profile.stripe_unit(),
    );
    let w = k * u;
    let size = data.len();
    assert!(size > 0, "client-side EC of an empty object");
    let stripes = size.div_ceil(w);
    let mut shards: Vec<Vec<SharedUnit>> = (0..k)
        .map(|j| {
            (0..stripes)
                .map(|s| s * w + j * u)
                .take_while(|&at| at < size)
                .map(|at| SharedUnit::new(data.clone(), at, u.min(size - at)))
                .collect()
        })
        .collect();
    // Parity: whole stripes straight from the caller's bytes, then the short last one padded.
    let last = size - (stripes - 1) * w;
    let last_unit = last.clamp(1, u);
    let len = (stripes - 1) * u + last_unit;
    // Encoded straight into the buffers the units share (a `Vec` turned into an `Arc<[u8]>`
    // afterwards would be copied once more).
    let mut parity: Vec<Arc<[u8]>> = (0..n - k)
        .map(|_| std::iter::repeat_n(0u8, len).collect())
        .collect();
    {
        let mut bufs: Vec<&mut [u8]> = parity
            .iter_mut()
            .map(|b| Arc::get_mut(b).expect("a parity buffer nobody shares yet"))
            .collect();
        let whole = if last == w { stripes } else { stripes - 1 };
        for s in 0..whole {
            let mut p: Vec<&mut [u8]> = bufs
                .iter_mut()
                .map(|v| &mut v[s * u..(s + 1) * u])
                .collect();
            codec.encode_stripe(&data[s * w..(s + 1) * w], &mut p);
        }
        if whole < stripes {
            let stripe = padded_last_stripe(data, k, u, whole, last_unit);
            let mut p: Vec<&mut [u8]> = bufs.iter_mut().map(|v| &mut v[whole * u..]).collect();
            codec.encode_stripe(&stripe, &mut p);
        }
    }
    // Parity is meaningful where shard 0 has bytes.
    let clip = (profile.shard_data_len(size as u64, 0) as usize).min(len);
    for buf in parity {
        shards.push(
            (0..clip)
                .step_by(u)
                .map(|at| SharedUnit::new(buf.clone(), at, u.min(clip - at)))
                .collect(),
        );
    }
    shards
}

/// The object's last, partly filled stripe (stripe `whole`) as `k` units of `last_unit`
/// bytes, zero-padded: what the encoder takes for it (the primary's `encode_full_units` too).
pub(crate) fn padded_last_stripe(
    data: &[u8],
    k: usize,
    u: usize,
    whole: usize,
    last_unit: usize,
) -> Vec<u8> {
    let (w, size) = (k * u, data.len());
    let mut stripe = vec![0u8; k * last_unit];
    for j in 0..k {
        let at = (whole * w + j * u).min(size);
        let src = &data[at..(at + last_unit).min(size)];
        stripe[j * last_unit..j * last_unit + src.len()].copy_from_slice(src);
    }
    stripe
}
