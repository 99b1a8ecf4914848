//! A blocking FIFO whose waiters park at once (mutex + condvar).
//!
//! Many threads per process wait on queues here (op threads, shard threads, a primary waiting
//! for its shard replies), and many processes share few cores. A channel whose receivers spin
//! and yield before parking keeps dozens of threads runnable for nothing under a steady trickle
//! of messages; measured on the 8-node local cluster, that spinning took more CPU than the
//! work itself. Waiters here sleep until notified.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

pub struct WaitQueue<T> {
    q: Mutex<(VecDeque<T>, bool)>,
    cv: Condvar,
}

impl<T> Default for WaitQueue<T> {
    fn default() -> Self {
        WaitQueue {
            q: Mutex::new((VecDeque::new(), false)),
            cv: Condvar::new(),
        }
    }
}

impl<T> WaitQueue<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&self, v: T) {
        self.q.lock().unwrap().0.push_back(v);
        self.cv.notify_one();
    }

    /// The next item; `None` once closed and drained.
    pub fn pop(&self) -> Option<T> {
        let mut g = self.q.lock().unwrap();
        loop {
            if let Some(v) = g.0.pop_front() {
                return Some(v);
            }
            if g.1 {
                return None;
            }
            g = self.cv.wait(g).unwrap();
        }
    }

    /// The next item, waiting at most until `deadline`.
    pub fn pop_until(&self, deadline: Instant) -> Option<T> {
        let mut g = self.q.lock().unwrap();
        loop {
            if let Some(v) = g.0.pop_front() {
                return Some(v);
            }
            let now = Instant::now();
            if g.1 || now >= deadline {
                return None;
            }
            g = self.cv.wait_timeout(g, deadline - now).unwrap().0;
        }
    }

    pub fn pop_timeout(&self, d: Duration) -> Option<T> {
        self.pop_until(Instant::now() + d)
    }

    /// Wake every waiter; `pop` returns `None` once the queue is empty.
    pub fn close(&self) {
        self.q.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
}

/// Collects a known number of items pushed by other threads. The waiter wakes once, when the
/// last one arrives (not once per item: a primary waiting for k + m shard replies would
/// otherwise be woken for each).
pub struct Gather<T> {
    items: Mutex<Vec<T>>,
    expected: usize,
    cv: Condvar,
}

impl<T> Gather<T> {
    pub fn new(expected: usize) -> Self {
        Gather {
            items: Mutex::new(Vec::with_capacity(expected)),
            expected,
            cv: Condvar::new(),
        }
    }

    pub fn push(&self, v: T) {
        let mut g = self.items.lock().unwrap();
        g.push(v);
        if g.len() >= self.expected {
            self.cv.notify_one();
        }
    }

    /// Every item, once `expected` have arrived (in arrival order).
    pub fn wait_all(&self) -> Vec<T> {
        let mut g = self.items.lock().unwrap();
        while g.len() < self.expected {
            g = self.cv.wait(g).unwrap();
        }
        std::mem::take(&mut *g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn fifo_across_threads_and_close() {
        let q = Arc::new(WaitQueue::new());
        let q2 = q.clone();
        let t = std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Some(v) = q2.pop() {
                got.push(v);
            }
            got
        });
        for i in 0..1000 {
            q.push(i);
        }
        q.close();
        assert_eq!(t.join().unwrap(), (0..1000).collect::<Vec<_>>());
        assert_eq!(
            WaitQueue::<u8>::new().pop_timeout(Duration::from_millis(1)),
            None
        );
    }
}
