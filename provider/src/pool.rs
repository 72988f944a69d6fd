//! A small pool of byte buffers, so that paths which hand a payload buffer away and get it back
//! (a sent message, a consumed unexpected message, a written frame) reuse its allocation instead
//! of allocating per message. Used by the engine and by providers (tcp-sim's frame queue).

/// At most `max_bufs` empty buffers of capacity at most `max_cap` bytes, kept for reuse.
#[derive(Debug)]
pub struct BufPool {
    bufs: Vec<Vec<u8>>,
    max_bufs: usize,
    max_cap: usize,
}

impl BufPool {
    /// A pool keeping up to `max_bufs` buffers, none larger than `max_cap` bytes.
    pub const fn new(max_bufs: usize, max_cap: usize) -> Self {
        BufPool {
            bufs: Vec::new(),
            max_bufs,
            max_cap,
        }
    }

    /// An empty buffer: a kept one if there is any, else a new one (which does not allocate
    /// until it is written).
    pub fn take(&mut self) -> Vec<u8> {
        self.bufs.pop().unwrap_or_default()
    }

    /// Give a buffer back; it is kept (emptied) if the pool has room and it is not too large.
    pub fn give(&mut self, mut buf: Vec<u8>) {
        let cap = buf.capacity();
        if self.bufs.len() < self.max_bufs && cap > 0 && cap <= self.max_cap {
            buf.clear();
            self.bufs.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::BufPool;

    #[test]
    fn reuses_what_fits_and_drops_the_rest() {
        let mut p = BufPool::new(2, 64);
        let mut a = p.take();
        a.extend_from_slice(&[1; 40]);
        let ptr = a.as_ptr();
        p.give(a);
        let b = p.take();
        assert!(
            b.is_empty() && b.as_ptr() == ptr,
            "the kept buffer comes back, emptied"
        );
        p.give(vec![0; 100]); // too large: dropped
        p.give(Vec::new()); // nothing to keep
        assert_eq!(p.take().capacity(), 0);
        for _ in 0..3 {
            p.give(vec![0; 8]);
        }
        assert_eq!(p.bufs.len(), 2, "never more than max_bufs");
    }
}
