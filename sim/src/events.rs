//! The deterministic event queue: integer time, ties broken by insertion order (FIFO).

use servelab_core::Nanos;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

struct Entry<E> {
    at: Nanos,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at && self.seq == o.seq
    }
}
impl<E> Eq for Entry<E> {}
impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl<E> Ord for Entry<E> {
    // BinaryHeap is a max-heap: reverse so the earliest (time, seq) pops first.
    fn cmp(&self, o: &Self) -> Ordering {
        o.at.cmp(&self.at).then(o.seq.cmp(&self.seq))
    }
}

/// Events ordered by (time, sequence number). Scheduling in the past is clamped to `now`, so
/// time never runs backwards.
pub struct EventQueue<E> {
    heap: BinaryHeap<Entry<E>>,
    seq: u64,
    now: Nanos,
    popped: u64,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> EventQueue<E> {
    pub fn new() -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
            seq: 0,
            now: Nanos::ZERO,
            popped: 0,
        }
    }
    pub fn now(&self) -> Nanos {
        self.now
    }
    pub fn len(&self) -> usize {
        self.heap.len()
    }
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
    /// Events handled so far.
    pub fn popped(&self) -> u64 {
        self.popped
    }
    pub fn push(&mut self, at: Nanos, event: E) {
        let at = at.max(self.now);
        self.heap.push(Entry {
            at,
            seq: self.seq,
            event,
        });
        self.seq += 1;
    }
    pub fn peek_time(&self) -> Option<Nanos> {
        self.heap.peek().map(|e| e.at)
    }
    pub fn pop(&mut self) -> Option<(Nanos, E)> {
        let e = self.heap.pop()?;
        self.now = e.at;
        self.popped += 1;
        Some((e.at, e.event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fifo_on_ties_and_no_time_travel() {
        let mut q = EventQueue::new();
        q.push(Nanos(5), 'a');
        q.push(Nanos(3), 'b');
        q.push(Nanos(5), 'c');
        q.push(Nanos(3), 'd');
        assert_eq!(q.pop(), Some((Nanos(3), 'b')));
        q.push(Nanos(1), 'e'); // in the past: runs now
        let rest: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            rest,
            vec![
                (Nanos(3), 'd'),
                (Nanos(3), 'e'),
                (Nanos(5), 'a'),
                (Nanos(5), 'c')
            ]
        );
    }

    proptest! {
        #[test]
        fn pops_sorted_by_time_then_insertion(ts in proptest::collection::vec(0u64..20, 0..200)) {
            let mut q = EventQueue::new();
            for (i, &t) in ts.iter().enumerate() { q.push(Nanos(t), i); }
            let mut expect: Vec<(u64, usize)> = ts.iter().copied().zip(0..).collect();
            expect.sort();
            let got: Vec<(u64, usize)> = std::iter::from_fn(|| q.pop()).map(|(t, i)| (t.0, i)).collect();
            prop_assert_eq!(got, expect);
        }
    }
}
