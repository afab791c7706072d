//! The requests a serving unit holds, by number.
//!
//! A unit numbers its requests 0, 1, 2, … in the order it is given them, and inputs and
//! outputs name them by that number. It holds only the numbers from the oldest request that
//! has not ended on: the front is dropped as requests end, so the unit's memory follows the
//! requests in flight, not the length of the run (a streamed day holds minutes of requests).

use std::collections::VecDeque;
use std::ops::{Index, IndexMut};

/// Entries numbered from 0 in the order they were pushed, of which those from
/// [`Window::base`] to [`Window::end`] are held.
#[derive(Clone, Debug)]
pub struct Window<T> {
    base: usize,
    items: VecDeque<T>,
}

impl<T> Default for Window<T> {
    fn default() -> Self {
        Window {
            base: 0,
            items: VecDeque::new(),
        }
    }
}

impl<T> Window<T> {
    pub fn with_capacity(n: usize) -> Self {
        Window {
            base: 0,
            items: VecDeque::with_capacity(n),
        }
    }

    /// Appends `item`; returns its number.
    pub fn push(&mut self, item: T) -> usize {
        self.items.push_back(item);
        self.end() - 1
    }

    /// The number of the oldest entry held.
    pub fn base(&self) -> usize {
        self.base
    }

    /// The number the next push gets (how many entries were ever pushed).
    pub fn end(&self) -> usize {
        self.base + self.items.len()
    }

    /// How many entries are held now.
    pub fn held(&self) -> usize {
        self.items.len()
    }

    /// Entry `i`, or `None` when it was dropped or not pushed yet.
    #[inline]
    pub fn get(&self, i: usize) -> Option<&T> {
        self.items.get(i.checked_sub(self.base)?)
    }

    pub fn front(&self) -> Option<&T> {
        self.items.front()
    }

    /// Drops the oldest entry held.
    pub fn pop_front(&mut self) -> Option<T> {
        let item = self.items.pop_front()?;
        self.base += 1;
        Some(item)
    }

    /// The entries held, with their numbers, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        let base = self.base;
        self.items
            .iter()
            .enumerate()
            .map(move |(k, t)| (base + k, t))
    }

    #[cold]
    fn missing(&self, i: usize) -> ! {
        panic!(
            "entry {i} is not held (held: {}..{})",
            self.base,
            self.end()
        )
    }
}

impl<T> Index<usize> for Window<T> {
    type Output = T;
    #[inline]
    fn index(&self, i: usize) -> &T {
        match i.checked_sub(self.base).and_then(|k| self.items.get(k)) {
            Some(t) => t,
            None => self.missing(i),
        }
    }
}

impl<T> IndexMut<usize> for Window<T> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        let (base, end) = (self.base, self.end());
        match i.checked_sub(base).and_then(|k| self.items.get_mut(k)) {
            Some(t) => t,
            None => panic!("entry {i} is not held (held: {base}..{end})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_survive_dropping_the_front() {
        let mut w = Window::default();
        for v in 10..15 {
            w.push(v);
        }
        assert_eq!((w.base(), w.end(), w.held()), (0, 5, 5));
        assert_eq!(w.pop_front(), Some(10));
        assert_eq!(w.pop_front(), Some(11));
        assert_eq!((w.base(), w.end(), w.held()), (2, 5, 3));
        assert_eq!(w[2], 12);
        assert_eq!(w.get(1), None);
        assert_eq!(w.get(5), None);
        w[4] = 40;
        assert_eq!(w.push(15), 5);
        let seen: Vec<(usize, i32)> = w.iter().map(|(i, &v)| (i, v)).collect();
        assert_eq!(seen, vec![(2, 12), (3, 13), (4, 40), (5, 15)]);
    }

    #[test]
    #[should_panic(expected = "entry 0 is not held (held: 1..2)")]
    fn a_dropped_entry_is_an_error() {
        let mut w = Window::default();
        w.push(1);
        w.push(2);
        w.pop_front();
        let _ = w[0];
    }
}
