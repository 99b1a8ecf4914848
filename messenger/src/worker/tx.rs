//! The send path: queued frames go out with vectored writes from the callers' buffers.

use super::*;
use crate::SendBuf;

#[derive(Default)]
pub(super) struct Tx {
    pub(super) queue: VecDeque<OutFrame>,
    /// Bytes of the queue's first frame already written.
    pub(super) head_done: usize,
    /// The last write hit EAGAIN: wait for EPOLLOUT.
    pub(super) blocked: bool,
}

impl Worker {
    // ---- send -------------------------------------------------------------------------------

    pub(super) fn queue_frame(&mut self, c: &mut Conn, frame: OutFrame) {
        c.tx.queue.push_back(frame);
        if !c.dirty {
            c.dirty = true;
            self.dirty.push(c.shared.slot);
        }
    }

    /// Write every dirty connection's queue, newest dirty first (a small reply queued this
    /// pass goes before the rest of a large one), each up to [`WRITE_QUANTUM`] bytes.
    /// The pass stops writing once it has written [`PASS_WRITE_BUDGET`] bytes: the connections
    /// not reached go on next pass, after the events and commands that arrived meanwhile.
    pub(super) fn flush_dirty(&mut self) -> u64 {
        let start = self.ctx.counters.bytes_out.get();
        while let Some(slot) = self.dirty.pop() {
            if self.ctx.counters.bytes_out.get() - start >= PASS_WRITE_BUDGET as u64 {
                // Still marked dirty: they stay so until written.
                self.dirty.push(slot);
                self.resume.append(&mut self.dirty);
                break;
            }
            let Some(Some(c)) = self.conns.get_mut(slot as usize) else {
                continue;
            };
            c.dirty = false;
            let gen = c.shared.gen;
            self.with_conn(slot, gen, |w, c| w.flush(c));
        }
        self.ctx.counters.bytes_out.get() - start
    }

    /// Write queued frames with vectored writes until done, the socket is full, or this
    /// pass's quantum is spent (then the connection goes on in the next pass, after the
    /// events and commands that arrived meanwhile).
    pub(super) fn flush(&mut self, c: &mut Conn) -> Result<(), Close> {
        if matches!(c.phase, Phase::Connecting | Phase::Backoff) {
            return Ok(());
        }
        let Some(sock) = c.sock.as_mut() else {
            return Ok(());
        };
        let r = write_queued(sock, &mut c.tx, &self.ctx.counters, WRITE_QUANTUM)?;
        c.tx.blocked = r == Written::Blocked;
        if r == Written::Quantum && !c.dirty {
            c.dirty = true;
            self.resume.push(c.shared.slot);
        }
        self.apply_interest(c)
    }
}

/// Most bytes one connection writes per worker pass. A 4 MiB reply goes out in a few passes,
/// so a small message on another connection of the same worker waits for at most this much
/// copying per busy connection, not for whole large messages (the hot-object storm: probe
/// replies queued behind 4 MiB replies). Measured on the 8-node local cluster, same runs:
/// 256 KiB gave the storm probe p50/p99 0.79/3.1 ms but cost 4 MiB writes ~7 %; 1 MiB gives
/// 0.92/4.2 ms for ~2 % (none: 1.5/6.6 ms).
pub(super) const WRITE_QUANTUM: usize = 1 << 20;

/// Most bytes one worker pass writes over all its connections before it looks at its socket
/// events and mailbox again. Without it a reply queued during a pass waited for every busy
/// connection's quantum: with 100 clients streaming 4 MiB replies from one worker, tens of
/// MiB of copying. `nvstore bench hot` (100 SCHED_IDLE clients, one 4 MiB object), same runs
/// alternating: probe p99 in the storm 2.65–3.54 ms (median 3.0) vs 3.37–3.87 (3.54) without,
/// hot reads/s 806 vs 720 (medians). 256 KiB measured no better. 4 MiB cluster writes did not
/// lose (711/691 vs 618/678 MB/s). A pass that writes all of it then yields the CPU
/// (`Worker::run_with_ready`); yielding after a quarter of it measured no better.
pub(super) const PASS_WRITE_BUDGET: usize = 1 << 20;

/// How a [`write_queued`] call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Written {
    /// The queue is empty.
    Done,
    /// The socket is full: wait for EPOLLOUT.
    Blocked,
    /// `quantum` bytes were written and more are queued.
    Quantum,
}

/// Write until the queue is empty, the socket is full, or `quantum` bytes are written. A short
/// write means the socket buffer is full: stop there rather than pay for a write that returns
/// EAGAIN.
pub(super) fn write_queued(
    sock: &mut TcpStream,
    tx: &mut Tx,
    counters: &WorkerCounters,
    quantum: usize,
) -> Result<Written, Close> {
    let mut left = quantum;
    let fd = sock.as_raw_fd();
    while !tx.queue.is_empty() {
        if left == 0 {
            return Ok(Written::Quantum);
        }
        let mut iov = [EMPTY_IOV; IOV_MAX];
        let k = gather(tx, &mut iov, left);
        let asked: usize = iov[..k].iter().map(|v| v.iov_len).sum();
        // SAFETY: the k iovecs describe bytes of frames in `tx.queue` (buffers the frames own,
        // or RawBytes regions valid while they live), which stay queued, unchanged, for the
        // whole call: `tx` is borrowed.
        let r = unsafe { libc::writev(fd, iov.as_ptr(), k as libc::c_int) };
        let r = if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        };
        match r {
            Ok(0) => return Err(Close::Io(io::ErrorKind::WriteZero.into())),
            Ok(n) => {
                counters.bytes_out.add(n as u64);
                counters.frames_out.add(consume(tx, n));
                left -= n.min(left);
                if n < asked {
                    return Ok(Written::Blocked);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Written::Blocked),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Close::Io(e)),
        }
    }
    Ok(Written::Done)
}

const EMPTY_IOV: libc::iovec = libc::iovec {
    iov_base: std::ptr::null_mut(),
    iov_len: 0,
};

/// Fill `iov` with up to `max` unwritten bytes of the queued frames, by address (a raw part
/// is never borrowed as a slice); returns how many entries.
pub(super) fn gather(tx: &Tx, iov: &mut [libc::iovec; IOV_MAX], max: usize) -> usize {
    let mut k = 0;
    let mut skip = tx.head_done;
    let mut room = max;
    'frames: for f in &tx.queue {
        let segs = std::iter::once((f.header.as_ptr(), f.header.len()))
            .chain(f.parts.iter().map(SendBuf::raw))
            .chain(std::iter::once((f.trailer.as_ptr(), f.trailer.len())));
        for (ptr, len) in segs {
            if skip >= len {
                skip -= len;
                continue;
            }
            let take = (len - skip).min(room);
            iov[k] = libc::iovec {
                // The address only: wrapping_add forms no reference and is in bounds here.
                iov_base: ptr.wrapping_add(skip) as *mut libc::c_void,
                iov_len: take,
            };
            skip = 0;
            k += 1;
            room -= take;
            if k == IOV_MAX || room == 0 {
                break 'frames;
            }
        }
    }
    k
}

/// Account `n` written bytes; returns how many frames completed.
pub(super) fn consume(tx: &mut Tx, mut n: usize) -> u64 {
    let mut done = 0;
    while let Some(f) = tx.queue.front() {
        let left = f.len - tx.head_done;
        if n < left {
            tx.head_done += n;
            break;
        }
        n -= left;
        tx.head_done = 0;
        tx.queue.pop_front();
        done += 1;
    }
    done
}
