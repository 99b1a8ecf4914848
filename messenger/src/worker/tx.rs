//! The send path: queued frames go out with vectored writes from the callers' buffers.

use super::*;

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

    pub(super) fn flush_dirty(&mut self) {
        while let Some(slot) = self.dirty.pop() {
            let Some(Some(c)) = self.conns.get_mut(slot as usize) else {
                continue;
            };
            c.dirty = false;
            let gen = c.shared.gen;
            self.with_conn(slot, gen, |w, c| w.flush(c));
        }
    }

    /// Write queued frames with vectored writes until done or the socket is full.
    pub(super) fn flush(&mut self, c: &mut Conn) -> Result<(), Close> {
        if matches!(c.phase, Phase::Connecting | Phase::Backoff) {
            return Ok(());
        }
        let Some(sock) = c.sock.as_mut() else {
            return Ok(());
        };
        c.tx.blocked = write_queued(sock, &mut c.tx, &self.ctx.counters)?;
        self.apply_interest(c)
    }
}

/// Write until the queue is empty (false) or the socket is full (true). A short write means
/// the socket buffer is full: stop there rather than pay for a write that returns EAGAIN.
pub(super) fn write_queued(
    sock: &mut TcpStream,
    tx: &mut Tx,
    counters: &WorkerCounters,
) -> Result<bool, Close> {
    while !tx.queue.is_empty() {
        let (r, asked) = {
            let mut iov = [IoSlice::new(&[]); IOV_MAX];
            let k = gather(tx, &mut iov);
            let asked: usize = iov[..k].iter().map(|s| s.len()).sum();
            (sock.write_vectored(&iov[..k]), asked)
        };
        match r {
            Ok(0) => return Err(Close::Io(io::ErrorKind::WriteZero.into())),
            Ok(n) => {
                counters.bytes_out.add(n as u64);
                counters.frames_out.add(consume(tx, n));
                if n < asked {
                    return Ok(true);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Close::Io(e)),
        }
    }
    Ok(false)
}

/// Fill `iov` with the unwritten bytes of the queued frames; returns how many slices.
pub(super) fn gather<'a>(tx: &'a Tx, iov: &mut [IoSlice<'a>; IOV_MAX]) -> usize {
    let mut k = 0;
    let mut skip = tx.head_done;
    'frames: for f in &tx.queue {
        let segs = std::iter::once(&f.header[..])
            .chain(f.parts.iter().map(|p| p.bytes()))
            .chain(std::iter::once(&f.trailer[..]));
        for seg in segs {
            if skip >= seg.len() {
                skip -= seg.len();
                continue;
            }
            iov[k] = IoSlice::new(&seg[skip..]);
            skip = 0;
            k += 1;
            if k == IOV_MAX {
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
