//! A generational operation table: ids that a late completion or reply for a finished
//! operation can never mistake for the operation that reuses its slot. An id is the slot's
//! generation in bits 32.. and its index in the low 32 bits; `GEN_BITS` says how many bits
//! the generation may take, so an id leaves the bits above free for the caller (the core keeps
//! bit 63 for RMA tokens: 31 bits; verbs-rc puts a work-request kind in bits 56..63: 24 bits).
//! A slot whose generation reaches the largest is retired instead of reused, so no id is issued
//! twice; no id is 0 (a C caller's "no token", a context pointer that must not be NULL).

/// An operation's id: generation in bits 32.., slot in the low 32.
pub type Id = u64;

#[derive(Debug)]
struct Slot<T> {
    gen: u32,
    item: Option<T>,
}

/// Live operations by [`Id`], with generations of `GEN_BITS` bits (1 to 31).
#[derive(Debug)]
pub struct Slab<T, const GEN_BITS: u32 = 31> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
}

impl<T, const GEN_BITS: u32> Default for Slab<T, GEN_BITS> {
    fn default() -> Self {
        Slab {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }
}

impl<T, const GEN_BITS: u32> Slab<T, GEN_BITS> {
    /// The largest generation: a slot that reaches it is retired instead of reused.
    pub const MAX_GEN: u32 = {
        assert!(GEN_BITS >= 1 && GEN_BITS <= 31, "1 to 31 generation bits");
        (1u32 << GEN_BITS) - 1
    };

    /// The id of slot `i` at generation `gen`.
    #[inline]
    fn id(gen: u32, i: usize) -> Id {
        ((gen as u64) << 32) | i as u64
    }

    /// The slot of `id`, if it is live at `id`'s generation.
    #[inline]
    fn slot(&self, id: Id) -> Option<&Slot<T>> {
        let s = self.slots.get((id & 0xffff_ffff) as usize)?;
        (s.gen as u64 == id >> 32).then_some(s)
    }

    #[inline]
    fn slot_mut(&mut self, id: Id) -> Option<&mut Slot<T>> {
        let s = self.slots.get_mut((id & 0xffff_ffff) as usize)?;
        (s.gen as u64 == id >> 32).then_some(s)
    }

    /// Insert the item `make` builds from its own id.
    #[inline]
    pub fn insert_with(&mut self, make: impl FnOnce(Id) -> T) -> Id {
        self.live += 1;
        if let Some(i) = self.free.pop() {
            let s = &mut self.slots[i as usize];
            // `remove` frees only slots whose generation can still grow.
            s.gen += 1;
            let id = Self::id(s.gen, i as usize);
            s.item = Some(make(id));
            id
        } else {
            let id = Self::id(1, self.slots.len());
            self.slots.push(Slot {
                gen: 1,
                item: Some(make(id)),
            });
            id
        }
    }

    /// Insert `r`; its id.
    #[inline]
    pub fn insert(&mut self, r: T) -> Id {
        self.insert_with(|_| r)
    }

    #[inline]
    pub fn get_mut(&mut self, id: Id) -> Option<&mut T> {
        self.slot_mut(id)?.item.as_mut()
    }

    #[inline]
    pub fn get(&self, id: Id) -> Option<&T> {
        self.slot(id)?.item.as_ref()
    }

    /// Whether `id` is live.
    #[inline]
    pub fn contains(&self, id: Id) -> bool {
        self.get(id).is_some()
    }

    /// Free `id`'s slot (`id` is live): it is reused unless it reached the last generation,
    /// then retired (a few bytes per 2^GEN_BITS uses of one slot), so a late completion for an
    /// old id can never reach a new operation.
    #[inline]
    fn release(&mut self, id: Id) {
        self.live -= 1;
        if ((id >> 32) as u32) < Self::MAX_GEN {
            self.free.push(id as u32);
        }
    }

    /// Remove `id` and give its item back; `None` if `id` is not live.
    #[inline]
    pub fn remove(&mut self, id: Id) -> Option<T> {
        let item = self.slot_mut(id)?.item.take()?;
        self.release(id);
        Some(item)
    }

    /// Remove `id`, dropping its item where it lies (no move of a large item out of the
    /// slab); false if `id` is not live.
    #[inline]
    pub fn discard(&mut self, id: Id) -> bool {
        let Some(s) = self.slot_mut(id) else {
            return false;
        };
        if s.item.is_none() {
            return false;
        }
        s.item = None;
        self.release(id);
        true
    }

    /// Ids of the live operations.
    pub fn ids(&self) -> Vec<Id> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.item.is_some())
            .map(|(i, s)| Self::id(s.gen, i))
            .collect()
    }

    /// The live operations, with their ids.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (Id, &mut T)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| Some((Self::id(s.gen, i), s.item.as_mut()?)))
    }

    /// Number of live operations.
    pub fn live(&self) -> usize {
        self.live
    }
}

#[cfg(test)]
mod tests {
    use super::Slab;

    /// A slot reused 2^31 times must neither issue an id with bit 63 set (the core's RMA
    /// tokens) nor wrap to an id it issued before (or to 0, "no token" in the C ABI).
    #[test]
    fn worn_out_slots_retire_instead_of_wrapping() {
        retire::<31>();
        retire::<24>();
        retire::<1>();
    }

    fn retire<const G: u32>() {
        let max = Slab::<u8, G>::MAX_GEN;
        let mut s = Slab::<u8, G>::default();
        let first = s.insert(0);
        s.remove(first);
        // Fast-forward slot 0 to just below the last generation.
        s.slots[0].gen = max.saturating_sub(2).max(1);
        let mut seen = Vec::new();
        for _ in 0..6 {
            let id = s.insert(0);
            assert_eq!(
                id >> (32 + G),
                0,
                "id {id:#x} has more than {G} generation bits"
            );
            assert_ne!(id, 0);
            assert!(!seen.contains(&id), "id {id:#x} issued twice");
            seen.push(id);
            if id & 1 == 0 {
                assert!(s.remove(id).is_some());
                assert!(s.remove(id).is_none(), "removed twice");
            } else {
                assert!(s.discard(id));
                assert!(!s.discard(id), "discarded twice");
            }
        }
        // Slot 0 retired at the last generation; later ids come from new slots.
        assert_eq!(s.slots[0].gen, max);
        assert!(s.slots.len() > 1);
        assert_eq!(s.live(), 0);
    }

    /// A late completion for a finished operation (its id) misses the one that reuses its slot.
    #[test]
    fn a_stale_id_misses_the_slot_s_new_operation() {
        let mut s = Slab::<&str, 24>::default();
        let old = s.insert("old");
        assert_eq!(s.remove(old), Some("old"));
        let new = s.insert("new");
        assert_eq!(new & 0xffff_ffff, old & 0xffff_ffff, "the slot is reused");
        assert_eq!(s.get(old), None);
        assert_eq!(s.remove(old), None);
        assert!(!s.discard(old));
        assert_eq!(s.get(new), Some(&"new"));
        let ids: Vec<_> = s.iter_mut().map(|(id, _)| id).collect();
        assert_eq!(ids, vec![new]);
        assert_eq!(s.ids(), vec![new]);
        assert!(s.get(u64::MAX).is_none() && s.get(0).is_none());
    }
}
