//! What arrives, as the hybrid's own sink between its channels and the core: the 5-byte prefix
//! checked, messages put back in order across channels (`weft_proto::order`), counted towards
//! the RC threshold, and the budget's control messages taken.

use super::*;

/// The sink the two channels report to: strips the hybrid prefix, restores order, feeds the
/// budget, and passes everything else on to the core.
pub(crate) struct Recv<'a> {
    pub(crate) core: &'a mut dyn Sink,
    pub(crate) chain: &'a JobChain,
    pub(crate) budget: &'a mut Budget<PeerState>,
    pub(crate) holding: &'a mut Holding<Held>,
    pub(crate) actions: &'a mut Vec<Action>,
    pub(crate) ctrl_in: &'a mut Vec<(Rank, Ctrl, u32)>,
    pub(crate) held: &'a mut u64,
}

impl Recv<'_> {
    fn malformed(&mut self, src: Rank, why: &str) {
        self.peer_failed(src, &format!("malformed hybrid message: {why}"));
    }
}

impl Sink for Recv<'_> {
    fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        let msg = match wire::decode(header) {
            Ok(m) => m,
            Err(why) => {
                if self.budget.peer(src).is_some_and(|p| !p.failed) {
                    self.malformed(src, &why);
                }
                return;
            }
        };
        if let wire::Msg::Data { seq, header: h } = msg {
            // Data, on every message: one look at the peer's record.
            let Some(p) = self.budget.peer_mut(src) else {
                return;
            };
            if p.failed {
                return;
            }
            let len = h.len() + payload.len();
            match p.reorder.arrive(self.holding, src, seq, len, || Held {
                header: h.to_vec(),
                payload: payload.to_vec(),
            }) {
                Ok(Arrival::Deliver) => {
                    self.core.am(src, h, payload);
                    while let Some(m) = p.reorder.pop(self.holding, src) {
                        self.core.am(src, &m.header, &m.payload);
                    }
                }
                Ok(Arrival::Held) => *self.held += 1,
                Err(e) => {
                    let why = e.to_string();
                    self.malformed(src, &why);
                    return;
                }
            }
            let chain = self.chain;
            self.budget
                .note_if(src, || rc_worthy(chain, payload.len() as u64), self.actions);
            return;
        }
        if self.budget.peer(src).is_none_or(|p| p.failed) {
            return;
        }
        // `Closed` carries the sender's next sequence number: everything it sent before (over
        // RC too) must be delivered here before the connection goes.
        if let wire::Msg::Ctrl { ctrl, seq } = msg {
            self.ctrl_in.push((src, ctrl, seq));
        }
    }

    fn complete(&mut self, token: Token, result: Result<Completed>) {
        self.core.complete(token, result);
    }

    fn peer_failed(&mut self, rank: Rank, reason: &str) {
        // Both channels may report the same peer: once is enough.
        if let Some(p) = self.budget.peer_mut(rank) {
            if !p.failed {
                p.failed = true;
                self.budget.peer_failed(rank);
                self.holding.forget(rank);
                self.core.peer_failed(rank, reason);
            }
        }
    }

    fn connection(&mut self, peer: Rank, event: ConnEvent) {
        self.core.connection(peer, event);
    }
}
