//! A list that keeps its first few entries inline. The engine's lists for one pod (indices
//! of entries to remove, names of volumes) mostly hold one or two entries, and a heap
//! allocation for each of them cost more than the work they record.

use std::ops::Deref;

/// Up to `N` entries inline, more on the heap.
#[derive(Clone, Debug)]
pub(super) enum SmallList<T: Copy + Default, const N: usize> {
    /// The first `len` entries of `items`.
    Inline { items: [T; N], len: usize },
    /// More than `N` entries.
    Heap(Vec<T>),
}

impl<T: Copy + Default, const N: usize> Default for SmallList<T, N> {
    fn default() -> Self {
        Self::Inline {
            items: [T::default(); N],
            len: 0,
        }
    }
}

impl<T: Copy + Default, const N: usize> SmallList<T, N> {
    /// Appends `item`.
    pub(super) fn push(&mut self, item: T) {
        let at = self.len();
        self.insert(at, item);
    }

    /// Inserts `item` at `index` (at most the length), moving the later entries up.
    pub(super) fn insert(&mut self, index: usize, item: T) {
        match self {
            Self::Inline { items, len } if *len < N => {
                items.copy_within(index..*len, index + 1);
                items[index] = item;
                *len += 1;
            }
            Self::Inline { items, .. } => {
                let mut heap = Vec::with_capacity(2 * N);
                heap.extend_from_slice(items);
                heap.insert(index, item);
                *self = Self::Heap(heap);
            }
            Self::Heap(heap) => heap.insert(index, item),
        }
    }

    /// Appends `item` unless the list already holds it.
    pub(super) fn push_new(&mut self, item: T)
    where
        T: PartialEq,
    {
        if !self.contains(&item) {
            self.push(item);
        }
    }

    /// Sets the entry at `index`.
    pub(super) fn set(&mut self, index: usize, item: T) {
        let slot = match self {
            Self::Inline { items, len } => items[..*len].get_mut(index),
            Self::Heap(heap) => heap.get_mut(index),
        };
        if let Some(slot) = slot {
            *slot = item;
        }
    }
}

impl<T: Copy + Default, const N: usize> Deref for SmallList<T, N> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Self::Inline { items, len } => &items[..*len],
            Self::Heap(heap) => heap,
        }
    }
}

impl<T: Copy + Default, const N: usize> FromIterator<T> for SmallList<T, N> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut list = Self::default();
        for item in iter {
            list.push(item);
        }
        list
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_list_is_a_vec_whether_inline_or_not() {
        // Inserts at the front, middle and end, past the inline room, against a Vec.
        for count in 0..12 {
            let mut list: SmallList<usize, 4> = SmallList::default();
            let mut vec = Vec::new();
            for i in 0..count {
                let at = (i * 7) % (vec.len() + 1);
                list.insert(at, i);
                vec.insert(at, i);
                assert_eq!(&*list, vec.as_slice(), "{count} entries");
            }
            if count > 0 {
                list.set(count / 2, 99);
                vec[count / 2] = 99;
            }
            list.set(count, 7);
            assert_eq!(&*list, vec.as_slice());
            let collected: SmallList<usize, 4> = vec.iter().copied().collect();
            assert_eq!(&*collected, vec.as_slice());
        }
    }

    #[test]
    fn push_new_keeps_each_entry_once_in_first_seen_order() {
        let mut list: SmallList<u8, 2> = SmallList::default();
        for item in [3, 1, 3, 2, 1, 4, 2] {
            list.push_new(item);
        }
        assert_eq!(&*list, &[3, 1, 2, 4]);
    }
}
