//! Submission and completion rings in device-visible memory (Base 1.4 §4.1). Entries are
//! written and read with volatile copies only: the controller reads the SQ and writes the CQ
//! behind the compiler's back, so no Rust reference into either ring is ever formed.

use std::sync::atomic::{fence, Ordering};

use super::spec::{Command, Completion, CQE_BYTES, CQE_STATUS_OFFSET, SQE_BYTES};
use crate::dma::DmaBuf;

/// A doorbell register in BAR0.
pub(crate) struct Doorbell(*mut u32);

// SAFETY: a doorbell is an MMIO register written with volatile stores; the BAR mapping outlives
// every ring (the controller owns the BAR, the queue holds the controller).
unsafe impl Send for Doorbell {}

impl Doorbell {
    pub(crate) fn new(ptr: *mut u32) -> Self {
        Doorbell(ptr)
    }

    fn write(&self, value: u32) {
        // SAFETY: ptr is a 4-byte aligned register inside the mapped BAR (Bar::register_ptr).
        unsafe { std::ptr::write_volatile(self.0, value) }
    }
}

/// Order every earlier store to queue memory before the doorbell write that follows.
///
/// Why: the SQ entries (and PRP lists, and data a write carries) are ordinary memory the
/// controller fetches *after* it sees the doorbell. Without a barrier the CPU may make the
/// doorbell store visible to the device before the entry stores. On x86 stores are not
/// reordered with each other and a full fence is more than needed, but it is cheap next to an
/// uncached MMIO write and is also correct on weakly ordered CPUs.
fn write_barrier() {
    fence(Ordering::SeqCst);
}

/// A submission queue ring.
pub(crate) struct Sq {
    mem: DmaBuf,
    entries: u16,
    tail: u16,
    /// The tail value last written to the doorbell.
    rung: u16,
    /// Controller's consumption point, from the SQHD field of completions.
    head: u16,
    doorbell: Doorbell,
}

impl Sq {
    /// `mem` must hold `entries` 64-byte entries and be page aligned.
    pub(crate) fn new(mem: DmaBuf, entries: u16, doorbell: Doorbell) -> Self {
        assert!(mem.len() >= entries as usize * SQE_BYTES && entries >= 2);
        Sq {
            mem,
            entries,
            tail: 0,
            rung: 0,
            head: 0,
            doorbell,
        }
    }

    pub(crate) fn iova(&self) -> u64 {
        self.mem.iova()
    }

    pub(crate) fn entries(&self) -> u16 {
        self.entries
    }

    /// Forget all state (after a controller reset or queue re-creation).
    pub(crate) fn reset(&mut self) {
        self.tail = 0;
        self.rung = 0;
        self.head = 0;
    }

    /// Free slots: one slot always stays empty to tell full from empty (Base 1.4 §4.1.2).
    pub(crate) fn space(&self) -> u16 {
        let used = (self.tail + self.entries - self.head) % self.entries;
        self.entries - 1 - used
    }

    /// Copy `cmd` into the slot at the tail. The caller checked `space() > 0`.
    pub(crate) fn push(&mut self, cmd: &Command) {
        debug_assert!(self.space() > 0, "SQ overflow");
        let slot = self.tail as usize * SQE_BYTES;
        // SAFETY: slot is inside mem (tail < entries, mem holds entries * 64 bytes) and 64-byte
        // aligned (page-aligned base), so aligned for Command. The controller only reads slots
        // between the doorbell tail and its head, which excludes this one until the doorbell.
        unsafe {
            std::ptr::write_volatile(self.mem.as_mut_ptr().add(slot) as *mut Command, *cmd);
        }
        self.tail = (self.tail + 1) % self.entries;
    }

    /// Record the controller's SQ head from a completion.
    pub(crate) fn set_head(&mut self, head: u16) {
        if head < self.entries {
            self.head = head;
        }
    }

    /// Ring the tail doorbell if anything was pushed since the last ring. Returns true if rung.
    pub(crate) fn ring(&mut self) -> bool {
        if self.tail == self.rung {
            return false;
        }
        write_barrier();
        self.doorbell.write(self.tail as u32);
        self.rung = self.tail;
        true
    }
}

/// A completion queue ring, consumed by phase tag (Base 1.4 §4.6).
pub(crate) struct Cq {
    mem: DmaBuf,
    entries: u16,
    head: u16,
    phase: bool,
    /// Entries consumed since the head doorbell was last written.
    unrung: u16,
    doorbell: Doorbell,
}

impl Cq {
    /// `mem` must hold `entries` 16-byte entries, be page aligned and zeroed.
    pub(crate) fn new(mem: DmaBuf, entries: u16, doorbell: Doorbell) -> Self {
        assert!(mem.len() >= entries as usize * CQE_BYTES && entries >= 2);
        Cq {
            mem,
            entries,
            head: 0,
            phase: true,
            unrung: 0,
            doorbell,
        }
    }

    pub(crate) fn iova(&self) -> u64 {
        self.mem.iova()
    }

    pub(crate) fn entries(&self) -> u16 {
        self.entries
    }

    /// Zero the ring and start over with phase 1 (before the queue is created again).
    pub(crate) fn reset(&mut self) {
        let len = self.entries as usize * CQE_BYTES;
        self.mem.fill(0, len, 0);
        self.head = 0;
        self.phase = true;
        self.unrung = 0;
    }

    /// The entry at the head if the controller has posted it (its phase tag matches ours).
    pub(crate) fn peek(&self) -> Option<Completion> {
        let at = self.head as usize * CQE_BYTES;
        // SAFETY: at + 16 <= mem.len() (head < entries); the status half-word is 2-byte aligned.
        let status = unsafe {
            std::ptr::read_volatile(self.mem.as_ptr().add(at + CQE_STATUS_OFFSET) as *const u16)
        };
        if (status & 1 == 1) != self.phase {
            return None;
        }
        // The phase tag is written last by the controller; order the read of the rest of the
        // entry after it.
        fence(Ordering::Acquire);
        // SAFETY: in bounds and 16-byte aligned (page-aligned base); a volatile copy.
        Some(unsafe { std::ptr::read_volatile(self.mem.as_ptr().add(at) as *const Completion) })
    }

    /// Consume the head entry.
    pub(crate) fn advance(&mut self) {
        self.head += 1;
        if self.head == self.entries {
            self.head = 0;
            self.phase = !self.phase;
        }
        self.unrung += 1;
    }

    /// Entries consumed but not yet reported through the head doorbell.
    pub(crate) fn unrung(&self) -> u16 {
        self.unrung
    }

    /// Tell the controller how far we consumed, once per batch.
    pub(crate) fn ring(&mut self) {
        if self.unrung == 0 {
            return;
        }
        // Our reads of the consumed entries must be done before the controller may reuse the
        // slots: order them before the head doorbell store.
        write_barrier();
        self.doorbell.write(self.head as u32);
        self.unrung = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::HostMemory;

    /// A CQE as the controller would post it.
    fn post(base: *mut u8, slot: usize, cid: u16, phase: bool) {
        let c = Completion {
            cid,
            sq_head: cid,
            status: phase as u16,
            ..Default::default()
        };
        // SAFETY: slot < entries of a buffer sized for them; the test plays the device.
        unsafe { std::ptr::write_volatile(base.add(slot * CQE_BYTES) as *mut Completion, c) };
    }

    #[test]
    fn cq_follows_the_phase_tag_across_a_wrap() {
        let mem = HostMemory::new(4096);
        let mut buf = mem.alloc(4 * CQE_BYTES).unwrap();
        let base = buf.as_mut_ptr();
        let mut db = Box::new(0u32);
        let mut cq = Cq::new(buf, 4, Doorbell::new(&mut *db as *mut u32));
        assert!(cq.peek().is_none(), "a zeroed ring has nothing posted");
        for cid in 0..4u16 {
            post(base, cid as usize, cid, true);
        }
        for cid in 0..4u16 {
            assert_eq!(cq.peek().map(|c| c.cid), Some(cid));
            cq.advance();
        }
        // Wrapped: slot 0 still holds the old entry with phase 1, which is now stale.
        assert!(
            cq.peek().is_none(),
            "old-phase entries are not new completions"
        );
        assert_eq!(cq.unrung(), 4);
        cq.ring();
        assert_eq!(*db, 0, "head doorbell holds the wrapped head");
        post(base, 0, 9, false);
        assert_eq!(
            cq.peek().map(|c| c.cid),
            Some(9),
            "the second pass expects phase 0"
        );
        cq.advance();
        cq.ring();
        assert_eq!(*db, 1);
        cq.reset();
        assert!(cq.peek().is_none(), "reset zeroes the ring");
    }

    #[test]
    fn sq_keeps_one_slot_free_and_rings_only_on_news() {
        let mem = HostMemory::new(4096);
        let buf = mem.alloc(4 * SQE_BYTES).unwrap();
        let mut db = Box::new(u32::MAX);
        let mut sq = Sq::new(buf, 4, Doorbell::new(&mut *db as *mut u32));
        assert_eq!(sq.space(), 3);
        assert!(!sq.ring(), "nothing pushed, no doorbell");
        assert_eq!(*db, u32::MAX);
        for _ in 0..3 {
            sq.push(&Command::new(0, 1));
        }
        assert_eq!(sq.space(), 0);
        assert!(sq.ring());
        assert_eq!(*db, 3);
        assert!(!sq.ring(), "no new entries since the last ring");
        sq.set_head(2);
        assert_eq!(sq.space(), 2);
        sq.push(&Command::new(0, 1));
        sq.push(&Command::new(0, 1));
        assert!(sq.ring());
        assert_eq!(*db, 1, "tail wrapped");
    }
}
