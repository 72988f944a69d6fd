//! Request ids: a generational slab. An id is the slot's generation in bits 32..63 and its
//! index in the low 32 bits, so a late completion or reply for a finished request never reaches
//! the request that reuses its slot.

/// Request id: generation in bits 32..63, slot in the low 32. Bit 63 is never set (that half of
/// the token space belongs to RMA, see [`super::TOKEN_RMA`]) and no id is 0 (which the C ABI
/// reads as "no token").
pub(crate) type ReqId = u64;

/// Largest slot generation: a slot whose generation reaches it is retired instead of reused,
/// so an id is never issued twice and never has bit 63 set.
pub(crate) const MAX_GEN: u32 = 0x7fff_ffff;

struct Slot<T> {
    gen: u32,
    item: Option<T>,
}

/// Live requests by [`ReqId`].
pub(crate) struct Slab<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }
}

impl<T> Slab<T> {
    /// Insert the item `make` builds from its own id.
    #[inline]
    pub(crate) fn insert_with(&mut self, make: impl FnOnce(ReqId) -> T) -> ReqId {
        self.live += 1;
        if let Some(i) = self.free.pop() {
            let s = &mut self.slots[i as usize];
            s.gen += 1;
            let id = ((s.gen as u64) << 32) | i as u64;
            s.item = Some(make(id));
            id
        } else {
            let id = (1u64 << 32) | self.slots.len() as u64;
            self.slots.push(Slot {
                gen: 1,
                item: Some(make(id)),
            });
            id
        }
    }

    #[inline]
    pub(crate) fn insert(&mut self, r: T) -> ReqId {
        self.live += 1;
        if let Some(i) = self.free.pop() {
            let s = &mut self.slots[i as usize];
            // `remove` frees only slots whose generation can still grow.
            s.gen += 1;
            s.item = Some(r);
            ((s.gen as u64) << 32) | i as u64
        } else {
            self.slots.push(Slot {
                gen: 1,
                item: Some(r),
            });
            (1u64 << 32) | (self.slots.len() - 1) as u64
        }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, id: ReqId) -> Option<&mut T> {
        let s = self.slots.get_mut((id & 0xffff_ffff) as usize)?;
        if s.gen as u64 != id >> 32 {
            return None;
        }
        s.item.as_mut()
    }

    #[inline]
    pub(crate) fn get(&self, id: ReqId) -> Option<&T> {
        let s = self.slots.get((id & 0xffff_ffff) as usize)?;
        if s.gen as u64 != id >> 32 {
            return None;
        }
        s.item.as_ref()
    }

    pub(crate) fn remove(&mut self, id: ReqId) -> Option<T> {
        let i = (id & 0xffff_ffff) as usize;
        let s = self.slots.get_mut(i)?;
        if s.gen as u64 != id >> 32 || s.item.is_none() {
            return None;
        }
        self.live -= 1;
        // A slot at the last generation is retired (a few bytes per 2^31 uses of one slot),
        // so a late completion for an old id can never reach a new request.
        if s.gen < MAX_GEN {
            self.free.push(i as u32);
        }
        s.item.take()
    }

    /// Remove `id`, dropping its item where it lies (no move of a large item out of the
    /// slab); false if `id` is not live.
    #[inline]
    pub(crate) fn discard(&mut self, id: ReqId) -> bool {
        let i = (id & 0xffff_ffff) as usize;
        let Some(s) = self.slots.get_mut(i) else {
            return false;
        };
        if s.gen as u64 != id >> 32 || s.item.is_none() {
            return false;
        }
        self.live -= 1;
        if s.gen < MAX_GEN {
            self.free.push(i as u32);
        }
        s.item = None;
        true
    }

    /// Ids of the live requests.
    pub(crate) fn ids(&self) -> Vec<ReqId> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.item.is_some())
            .map(|(i, s)| ((s.gen as u64) << 32) | i as u64)
            .collect()
    }

    /// Number of live requests.
    pub(crate) fn live(&self) -> usize {
        self.live
    }
}

#[cfg(test)]
mod tests {
    use super::{Slab, MAX_GEN};

    /// A slot reused 2^31 times must neither issue an id that looks like an RMA token (bit 63)
    /// nor wrap to an id it issued before (or to 0, "no token" in the C ABI).
    #[test]
    fn worn_out_slots_retire_instead_of_wrapping() {
        let mut s = Slab::<u8>::default();
        let first = s.insert(0);
        s.remove(first);
        // Fast-forward slot 0 to just below the last generation.
        s.slots[0].gen = MAX_GEN - 2;
        let mut seen = Vec::new();
        for _ in 0..6 {
            let id = s.insert(0);
            assert_eq!(id >> 63, 0, "id {id:#x} has the RMA-token bit");
            assert_ne!(id, 0);
            assert!(!seen.contains(&id), "id {id:#x} issued twice");
            seen.push(id);
            if id & 1 == 0 {
                assert!(s.remove(id).is_some());
            } else {
                assert!(s.discard(id));
                assert!(!s.discard(id), "discarded twice");
            }
        }
        // Slot 0 retired at MAX_GEN; later ids come from new slots.
        assert_eq!(s.slots[0].gen, MAX_GEN);
        assert!(s.slots.len() > 1);
        assert_eq!(s.live, 0);
    }
}
