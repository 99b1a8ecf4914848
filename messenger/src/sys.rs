//! The operating-system pieces of the event loop: epoll with a nanosecond timeout, an eventfd
//! for cross-thread wakes, the floored sleep computation, and per-thread CPU readings.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// How long the event loop sleeps when nothing is ready. `None` blocks until an event.
///
/// This is the fix for the incident: the sleep towards the next timer is computed in
/// nanoseconds and **floored** at `floor`, so it is never zero (never a spinning
/// `epoll_wait(0)`) however close the timer is or however coarse a clock would round it. A timer
/// due inside the floor fires on the next wake, at most `floor` (plus kernel timer slack) late.
/// A timer already due gets the floor too: the caller has just run the due timers, so one due
/// now was armed during that pass, and firing it at once would let a self-re-arming timer spin
/// the loop.
pub fn sleep_timeout(
    now: Instant,
    next_timer: Option<Instant>,
    floor: Duration,
) -> Option<Duration> {
    debug_assert!(!floor.is_zero(), "a zero floor brings back the spin");
    next_timer.map(|due| due.saturating_duration_since(now).max(floor))
}

/// Milliseconds for plain `epoll_wait` (the fallback when `epoll_pwait2` is missing): rounded
/// **up**, so a sub-millisecond wait is 1 ms, never 0.
pub fn timeout_ms_rounded_up(d: Duration) -> i32 {
    if d.is_zero() {
        return 0;
    }
    let ms = d.as_nanos().div_ceil(1_000_000);
    ms.min(i32::MAX as u128) as i32
}

static NO_PWAIT2: AtomicBool = AtomicBool::new(false);

pub struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall; on success the returned fd is new and owned by us.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a freshly created descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Epoll { fd })
    }

    fn ctl(&self, op: i32, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call; the kernel copies it.
        let r = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, token)
    }

    pub fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, token)
    }

    pub fn delete(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0)
    }

    /// Wait for events. `timeout`: `None` blocks, `Some(ZERO)` polls, anything else sleeps that
    /// long with nanosecond precision (`epoll_pwait2`), or rounded up to whole milliseconds on
    /// kernels before 5.11.
    pub fn wait(
        &self,
        events: &mut [libc::epoll_event],
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        let max = events.len().min(i32::MAX as usize) as i32;
        let n = match timeout {
            Some(d) if !d.is_zero() && !NO_PWAIT2.load(Relaxed) => {
                let ts = libc::timespec {
                    tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
                    tv_nsec: d.subsec_nanos() as libc::c_long,
                };
                // SAFETY: `events` is a valid writable array of `max` entries and `ts` lives
                // across the call; a null sigmask means the signal mask is unchanged.
                let r = unsafe {
                    libc::epoll_pwait2(
                        self.fd.as_raw_fd(),
                        events.as_mut_ptr(),
                        max,
                        &ts,
                        std::ptr::null(),
                    )
                };
                if r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                    NO_PWAIT2.store(true, Relaxed);
                    return self.wait(events, timeout);
                }
                r
            }
            _ => {
                let ms = timeout.map_or(-1, timeout_ms_rounded_up);
                // SAFETY: `events` is a valid writable array of `max` entries.
                unsafe { libc::epoll_wait(self.fd.as_raw_fd(), events.as_mut_ptr(), max, ms) }
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(e);
        }
        Ok(n as usize)
    }
}

/// A non-blocking eventfd used to wake a sleeping worker.
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain syscall; on success the returned fd is new and owned by us.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a freshly created descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd. A failure can only be EAGAIN
        // (counter saturated), which means a wake is already pending: nothing to do.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd; EAGAIN (nothing
        // pending) is fine.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

/// Give the CPU to another runnable thread, if any (returns at once otherwise).
pub fn yield_cpu() {
    // SAFETY: sched_yield has no preconditions.
    unsafe { libc::sched_yield() };
}

/// This thread's kernel thread id (for /proc/self/task/TID).
pub fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// CPU time of a thread of this process, in clock ticks (utime + stime, fields 14 and 15 of
/// /proc/self/task/TID/stat; `ticks_per_second` converts).
pub fn thread_cpu_ticks(tid: i32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))?;
    // The command name (field 2) may contain spaces; fields after it follow the last ')'.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| io::Error::other("bad stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14 -> index 11, stime 15 -> index 12.
    let num = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .ok_or_else(|| io::Error::other("bad stat field"))
    };
    Ok(num(11)? + num(12)?)
}

/// CPU time of a thread of this process in nanoseconds (first field of
/// /proc/self/task/TID/schedstat): finer than ticks.
pub fn thread_cpu_ns(tid: i32) -> io::Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))?;
    s.split_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| io::Error::other("bad schedstat"))
}

pub fn ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The incident's arithmetic: a timer 500 ns ahead truncated to whole microseconds gave a
    /// zero timeout and `epoll_wait(…, 0)` spun. Ours is floored, whatever the distance.
    #[test]
    fn sleep_is_never_zero_for_a_timer_in_the_future_or_just_past() {
        let now = Instant::now();
        let floor = Duration::from_micros(50);
        for ahead_ns in [0u64, 1, 500, 999, 1_000, 49_999] {
            let t = sleep_timeout(now, Some(now + Duration::from_nanos(ahead_ns)), floor);
            assert_eq!(t, Some(floor), "timer {ahead_ns} ns ahead");
        }
        assert_eq!(
            sleep_timeout(now, Some(now + Duration::from_millis(3)), floor),
            Some(Duration::from_millis(3))
        );
        assert_eq!(sleep_timeout(now, None, floor), None, "no timer: block");
    }

    #[test]
    fn millisecond_fallback_rounds_up() {
        assert_eq!(timeout_ms_rounded_up(Duration::from_nanos(1)), 1);
        assert_eq!(timeout_ms_rounded_up(Duration::from_micros(999)), 1);
        assert_eq!(timeout_ms_rounded_up(Duration::from_micros(1001)), 2);
        assert_eq!(timeout_ms_rounded_up(Duration::ZERO), 0);
    }

    #[test]
    fn epoll_pwait2_sleeps_about_the_asked_time_and_eventfd_wakes_it() {
        let ep = Epoll::new().unwrap();
        let ev = EventFd::new().unwrap();
        ep.add(ev.raw(), libc::EPOLLIN as u32, 7).unwrap();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
        let t0 = Instant::now();
        assert_eq!(
            ep.wait(&mut events, Some(Duration::from_micros(200)))
                .unwrap(),
            0
        );
        assert!(
            t0.elapsed() >= Duration::from_micros(200),
            "returned before the timeout"
        );
        ev.notify();
        assert_eq!(ep.wait(&mut events, None).unwrap(), 1);
        let token = events[0].u64;
        assert_eq!(token, 7);
        ev.drain();
        assert_eq!(ep.wait(&mut events, Some(Duration::ZERO)).unwrap(), 0);
    }

    #[test]
    fn thread_cpu_readings_parse() {
        let tid = gettid();
        let ns0 = thread_cpu_ns(tid).unwrap();
        // The kernel updates the reading at scheduler events and ticks: burn CPU until it
        // moves (bounded, so a reading that never moves fails instead of hanging).
        let t0 = std::time::Instant::now();
        let mut x = 0u64;
        let mut i = 0u64;
        while thread_cpu_ns(tid).unwrap() == ns0 && t0.elapsed() < Duration::from_secs(5) {
            for _ in 0..100_000 {
                x = x.wrapping_mul(31).wrapping_add(std::hint::black_box(i));
                i += 1;
            }
        }
        std::hint::black_box(x);
        assert!(
            thread_cpu_ns(tid).unwrap() > ns0,
            "thread CPU time did not advance in 5 s of spinning"
        );
        thread_cpu_ticks(tid).unwrap();
        assert!(ticks_per_second() > 0);
    }
}
