//! Scrub: read and verify every chunk and xattr map the index references, resumably and at a
//! bounded rate, and report what it found.

use std::ops::Bound;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, RecvTimeoutError, TryRecvError};

use driver::BlockDevice;

use crate::error::StoreError;
use crate::format::ChunkRef;
use crate::key::ObjectKey;
use crate::{ScrubSchedule, Shared, Store};

/// A chunk whose bytes do not match their CRC32C.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptChunk {
    pub key: ObjectKey,
    /// Chunk index, or `None` for the xattr map.
    pub chunk: Option<usize>,
    pub offset: u64,
    pub expected: u32,
    pub found: u32,
}

#[derive(Debug, Clone, Default)]
pub struct ScrubReport {
    pub objects: u64,
    pub chunks: u64,
    pub bytes: u64,
    pub corrupt: Vec<CorruptChunk>,
    /// Other read failures (media errors), by key.
    pub errors: Vec<(ObjectKey, String)>,
    /// Where to resume; `None` when the whole index was covered.
    pub resume_after: Option<ObjectKey>,
    pub elapsed: Duration,
}

impl<D: BlockDevice + 'static> Store<D> {
    /// Verify the whole store.
    pub fn scrub(&self) -> ScrubReport {
        self.scrub_step(None, u64::MAX, None)
    }

    /// Verify objects after `after`, stopping once `max_bytes` were read; with `bytes_per_sec`,
    /// sleep as needed to stay under that rate. Resume with the report's `resume_after`.
    pub fn scrub_step(
        &self,
        after: Option<ObjectKey>,
        max_bytes: u64,
        bytes_per_sec: Option<u64>,
    ) -> ScrubReport {
        self.sh.scrub_step(after, max_bytes, bytes_per_sec)
    }
}

/// The background scrub thread: a rate-limited pass every `interval`, resumable in steps.
pub(crate) fn background<D: BlockDevice>(sh: Arc<Shared<D>>, s: ScrubSchedule, stop: Receiver<()>) {
    const STEP_BYTES: u64 = 16 << 20;
    loop {
        let t0 = Instant::now();
        let mut pass = ScrubReport::default();
        let mut cursor = None;
        loop {
            if !matches!(stop.try_recv(), Err(TryRecvError::Empty)) {
                return;
            }
            let step = sh.scrub_step(cursor, STEP_BYTES, Some(s.bytes_per_sec));
            pass.objects += step.objects;
            pass.chunks += step.chunks;
            pass.bytes += step.bytes;
            pass.corrupt.extend(step.corrupt);
            pass.errors.extend(step.errors);
            cursor = step.resume_after;
            if cursor.is_none() {
                break;
            }
        }
        pass.elapsed = t0.elapsed();
        if !pass.corrupt.is_empty() {
            tracing::error!(corrupt = pass.corrupt.len(), "scrub found corrupt chunks");
        }
        *sh.last_scrub.lock().unwrap() = Some(pass);
        match stop.recv_timeout(s.interval.saturating_sub(t0.elapsed())) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
    }
}

impl<D: BlockDevice> Shared<D> {
    fn scrub_step(
        &self,
        after: Option<ObjectKey>,
        max_bytes: u64,
        bytes_per_sec: Option<u64>,
    ) -> ScrubReport {
        let t0 = Instant::now();
        let mut rep = ScrubReport::default();
        let lower = match &after {
            Some(k) => Bound::Excluded(k.clone()),
            None => Bound::Unbounded,
        };
        for e in self.index.range((lower, Bound::Unbounded)) {
            let (key, m) = (e.key().clone(), e.value().load_full());
            rep.objects += 1;
            let refs: Vec<(Option<usize>, ChunkRef)> = m
                .chunks
                .iter()
                .enumerate()
                .map(|(i, r)| (Some(i), *r))
                .chain([(None, m.xattrs)])
                .filter(|(_, r)| r.len.get() > 0)
                .collect();
            for (chunk, r) in refs {
                rep.chunks += 1;
                rep.bytes += r.len.get() as u64;
                match self.read_ref_vec(&r, "object chunk") {
                    Ok(_) => {}
                    Err(StoreError::Corrupted {
                        expected, found, ..
                    }) => {
                        // A relocation may have raced with us: only report if still current.
                        let current = self.index.state_seq(&key).is_some_and(|s| s == m.state_seq);
                        if current {
                            rep.corrupt.push(CorruptChunk {
                                key: key.clone(),
                                chunk,
                                offset: r.offset.get(),
                                expected,
                                found,
                            });
                        }
                    }
                    Err(e) => rep.errors.push((key.clone(), e.to_string())),
                }
            }
            if let Some(rate) = bytes_per_sec {
                let due = Duration::from_secs_f64(rep.bytes as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(t0.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
            if rep.bytes >= max_bytes {
                rep.resume_after = Some(key);
                break;
            }
        }
        rep.elapsed = t0.elapsed();
        rep
    }
}
