//! The checkpoint encoder: a thread that walks the index and encodes it as batches of
//! object-state records, which the commit thread writes between and beside its rounds.
//!
//! Walking a large index is the expensive part of a checkpoint: every entry is a skip-list
//! node and an object state, each a likely cache miss (on the 49th stop's 2-vCPU host, 48 % of
//! the commit thread's time in the 4 KiB puts benchmark, during which no round could start).
//! Here it runs beside the commit thread, which only copies finished batches to the device.
//!
//! The walk sees the index as the rounds applied so far leave it, entry by entry: a fuzzy
//! snapshot. That is enough: a checkpoint begins with no round in flight and records that
//! log position, so every change it may have missed (or half-seen) is in the log after it, and
//! replay applies a record only where its op sequence is newer than the state it finds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{bounded, unbounded, Receiver, Sender};
use driver::BlockDevice;

use crate::meta::encode_state;
use crate::Shared;

/// Encoded batches waiting for the commit thread: the encoder runs at most this far ahead, so
/// its buffers stay bounded (each about `meta_max`) whatever the commit thread is doing.
const AHEAD_BATCHES: usize = 2;

/// One batch's records.
pub(crate) struct Encoded {
    /// The checkpoint it belongs to (a cancelled one's batches are dropped).
    pub id: u64,
    pub meta: Vec<u8>,
    pub count: u32,
    /// The walk is done: this is the checkpoint's last batch (it may hold no record).
    pub last: bool,
}

pub(crate) struct Encoder {
    jobs: Option<Sender<u64>>,
    out: Option<Receiver<Encoded>>,
    /// Buffers the commit thread is done with, for the encoder to reuse.
    free: Sender<Vec<u8>>,
    /// The checkpoint being encoded (0: none); the walk stops when this moves on.
    current: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Encoder {
    /// Start the thread. A batch is closed once its records reach `meta_max` bytes.
    pub fn start<D: BlockDevice + 'static>(
        sh: Arc<Shared<D>>,
        meta_max: usize,
    ) -> std::io::Result<Encoder> {
        let (jobs_tx, jobs_rx) = unbounded::<u64>();
        let (out_tx, out_rx) = bounded::<Encoded>(AHEAD_BATCHES);
        let (free_tx, free_rx) = unbounded::<Vec<u8>>();
        let current = Arc::new(AtomicU64::new(0));
        let cur = current.clone();
        let thread = std::thread::Builder::new()
            .name("store-ckpt".into())
            .spawn(move || {
                while let Ok(id) = jobs_rx.recv() {
                    if !walk(&sh, id, meta_max, &cur, &out_tx, &free_rx) {
                        return;
                    }
                }
            })?;
        Ok(Encoder {
            jobs: Some(jobs_tx),
            out: Some(out_rx),
            free: free_tx,
            current,
            thread: Some(thread),
        })
    }

    /// Encode checkpoint `id` (non-zero): its batches arrive on [`Encoder::out`] in key order,
    /// the last one flagged.
    pub fn begin(&self, id: u64) {
        self.current.store(id, Ordering::Relaxed);
        if let Some(j) = &self.jobs {
            // The thread outlives the encoder's senders; a send fails only if it panicked,
            // which `out` then reports as disconnected.
            let _ = j.send(id);
        }
    }

    /// Stop encoding the current checkpoint (its batches still queued are dropped by id).
    pub fn cancel(&self) {
        self.current.store(0, Ordering::Relaxed);
    }

    pub fn out(&self) -> &Receiver<Encoded> {
        self.out.as_ref().expect("open until dropped")
    }

    /// Give a written batch's buffer back.
    pub fn recycle(&self, mut meta: Vec<u8>) {
        meta.clear();
        let _ = self.free.send(meta);
    }
}

impl Drop for Encoder {
    fn drop(&mut self) {
        self.cancel();
        // Without senders or a receiver, the thread's next `recv` or `send` fails and it ends.
        self.jobs.take();
        self.out.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Encode checkpoint `id`. Returns false when the commit side is gone.
fn walk<D: BlockDevice>(
    sh: &Shared<D>,
    id: u64,
    meta_max: usize,
    current: &AtomicU64,
    out: &Sender<Encoded>,
    free: &Receiver<Vec<u8>>,
) -> bool {
    let mut entries = sh.index.iter();
    loop {
        let mut meta = free
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(meta_max + (4 << 10)));
        let mut count = 0u32;
        let mut last = true;
        for e in entries.by_ref() {
            encode_state(e.key(), &e.value().load(), &mut meta);
            count += 1;
            if meta.len() >= meta_max {
                last = false;
                break;
            }
        }
        if current.load(Ordering::Relaxed) != id {
            // Cancelled: this job is over.
            return true;
        }
        let batch = Encoded {
            id,
            meta,
            count,
            last,
        };
        if out.send(batch).is_err() {
            return false;
        }
        if last {
            return true;
        }
    }
}
