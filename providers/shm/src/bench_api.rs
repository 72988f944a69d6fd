//! The queue protocols on ordinary heap memory, for the criterion benchmarks in
//! `providers/shm/benches/` (not part of the provider's API).
//!
//! One sender and one receiver on the calling thread: what `send` + `recv` cost without the
//! segment, the engine or a second core, so that the ring and MPSC variants and the inline and
//! data-area paths can be compared operation by operation.

use crate::queue::{self, Cell, DataState, Line, SendState, Tails, Unit};
use crate::sync::UnsafeCell;

/// Which small-message queue to exercise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// Per-pair SPSC ring with a doorbell.
    Ring,
    /// Per-receiver MPSC queue (senders reserve positions with a CAS).
    Mpsc,
}

/// One sender → receiver queue with its data area.
pub struct Pair {
    flavour: Flavour,
    cells: Vec<Cell>,
    data: Vec<Unit>,
    tails: Tails,
    enq: Line,
    bell: Vec<Line>,
    st: SendState,
    ds: DataState,
    rpos: u64,
}

impl Pair {
    /// `cells` message cells and `data_bytes` of data area (rounded up to whole units).
    pub fn new(flavour: Flavour, cells: usize, data_bytes: usize) -> Pair {
        Pair {
            flavour,
            cells: (0..cells as u64).map(Cell::new).collect(),
            data: (0..data_bytes.div_ceil(queue::UNIT))
                .map(|_| UnsafeCell::new([0; queue::UNIT]))
                .collect(),
            tails: Tails::new(),
            enq: Line::new(0),
            bell: vec![Line::new(0)],
            st: SendState::default(),
            ds: DataState::default(),
            rpos: 0,
        }
    }

    /// Enqueue one message (header + payload); `false` when the queue is full.
    pub fn send(&mut self, hdr: &[u8], payload: &[u8]) -> bool {
        let parts = [payload];
        let ok = match self.flavour {
            Flavour::Ring => queue::ring_send(
                &self.cells,
                &self.data,
                &self.tails,
                &mut self.st,
                0,
                hdr,
                &parts,
                payload.len(),
            ),
            Flavour::Mpsc => queue::mpsc_send(
                &self.enq,
                &self.cells,
                &self.data,
                &self.tails.data,
                &mut self.st,
                0,
                hdr,
                &parts,
                payload.len(),
            ),
        };
        if ok && self.flavour == Flavour::Ring {
            queue::ring_bell(&self.bell, 0);
        }
        ok
    }

    /// Dequeue one message, copying its payload into `out`; its length, or `None` when empty.
    pub fn recv(&mut self, out: &mut [u8]) -> Option<usize> {
        let data = &self.data;
        let got = queue::peek(&self.cells, self.rpos, |_| Some(&data[..]))?;
        let (meta, n) = match got {
            Ok(r) => {
                let n = r.payload.len().min(out.len());
                out[..n].copy_from_slice(&r.payload[..n]);
                (r.meta, Some(n))
            }
            Err((meta, _)) => (meta, None),
        };
        let nunits = self.data.len();
        match self.flavour {
            Flavour::Ring => {
                queue::release_ring(self.cells.len(), &meta, &mut self.ds, &self.tails, nunits);
                // One receive at a time: publish as a receiver going idle would.
                queue::flush_tails(&mut self.ds, &self.tails);
            }
            Flavour::Mpsc => queue::release(
                &self.cells,
                self.rpos,
                &meta,
                Some((&mut self.ds, &self.tails.data, nunits)),
            ),
        }
        self.rpos += 1;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_inline_and_data_area_payloads() {
        for f in [Flavour::Ring, Flavour::Mpsc] {
            let mut p = Pair::new(f, 4, 16 * 1024);
            let mut out = vec![0u8; 4096];
            for round in 0..50u8 {
                let small = [round; 16];
                let big = vec![round ^ 0x5a; 3000];
                assert!(p.send(b"h", &small));
                assert!(p.send(b"h", &big));
                assert_eq!(p.recv(&mut out), Some(16));
                assert_eq!(&out[..16], &small);
                assert_eq!(p.recv(&mut out), Some(3000));
                assert_eq!(&out[..3000], &big[..]);
                assert_eq!(p.recv(&mut out), None);
            }
            // Full after `cells` messages, usable again after a receive.
            for _ in 0..4 {
                assert!(p.send(b"", &[1]));
            }
            assert!(
                !p.send(b"", &[1]),
                "{f:?}: a fifth message fits in four cells"
            );
            assert_eq!(p.recv(&mut out), Some(1));
            assert!(p.send(b"", &[1]));
        }
    }
}
