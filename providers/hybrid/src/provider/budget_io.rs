//! The budget's decisions carried out (the budget itself, without I/O, is `budget.rs`):
//! connections opened, drained and closed on verbs-rc, control messages sent.

use super::*;

impl Hybrid {
    /// Carry out what the budget asked for.
    pub(crate) fn run_actions(&mut self) -> Result<()> {
        for a in std::mem::take(&mut self.actions) {
            match a {
                Action::Send(p, c) => self.ctrl_out.push_back((p, c)),
                Action::Connect(p) => {
                    if !self.failed(p) {
                        self.rc_active = true;
                        self.rc.connect(p)?;
                    }
                }
                // verbs-rc sets up RC-FP slots itself at connection (at most MAX_FP peers);
                // a slot a teardown freed goes to the connection the budget names.
                Action::OpenFp(p) => self.rc.open_fast_path(p)?,
                // The slots go with the connection; draining stops the ring writes.
                Action::CloseFp(_) => {}
                Action::Drain(p) => {
                    self.rc.quiesce(p)?;
                    // Rendezvous with the peer go by UD-ZCOPY from now on.
                    self.caps_changed.push(p);
                    if !self.draining.iter().any(|d| d.0 == p) {
                        self.draining.push((p, false));
                    }
                }
                Action::Teardown(p) => {
                    let upto = self
                        .closed_at
                        .iter()
                        .find(|&&(r, _)| r == p)
                        .map_or(0, |&(_, s)| s);
                    self.closed_at.retain(|&(r, _)| r != p);
                    self.teardown.push((p, upto));
                }
            }
        }
        self.flush_ctrl()
    }

    /// Rebalancing: report drained connections to the budget, and tear down those both sides
    /// drained once the peer's messages sent before its `Closed` have all been delivered (the
    /// last of them may still sit in RC's queues behind the `Closed` that came by UD).
    ///
    /// A peer is reported drained no earlier than the second `closing` after its drain began.
    /// Until the core has read the peer's new capabilities (the `CapsChanged` event goes out at
    /// the end of this `progress`, and the core reads it after it has issued the RMA reads it
    /// decided meanwhile), a rendezvous matched under the old ones still reads over RC; once
    /// drained is reported the peer may destroy its end, and such a read would find nobody
    /// there. By the second call every such read has been posted, so `quiet` counts it. A
    /// teardown likewise waits until nothing of ours to the peer is in flight.
    pub(crate) fn closing(&mut self) -> Result<()> {
        let mut k = 0;
        while k < self.draining.len() {
            let (p, armed) = self.draining[k];
            if !armed {
                self.draining[k].1 = true;
                k += 1;
            } else if self.rc.quiet(p) {
                self.draining.swap_remove(k);
                self.budget.drained(p, &mut self.actions);
            } else {
                k += 1;
            }
        }
        let mut k = 0;
        while k < self.teardown.len() {
            let (p, upto) = self.teardown[k];
            let (delivered, failed) = self
                .budget
                .peer(p)
                .map_or((0, true), |s| (s.reorder.expected(), s.failed));
            // Every number before `upto` delivered (wrap-safe), and nothing of ours in flight.
            if failed || (upto.wrapping_sub(delivered) as i32 <= 0 && self.rc.quiet(p)) {
                self.teardown.swap_remove(k);
                self.rc.disconnect(p)?;
                // The budget may have agreed on a new connection meanwhile (verbs-rc ignored
                // the connect while the old one stood): make it now.
                if self.budget.state(p) == RcState::Up && !self.failed(p) {
                    self.rc.connect(p)?;
                }
            } else {
                k += 1;
            }
        }
        if !self.actions.is_empty() {
            self.run_actions()?;
        }
        Ok(())
    }

    /// Send the control messages waiting, in order, until UD has no room.
    pub(crate) fn flush_ctrl(&mut self) -> Result<()> {
        while let Some(&(p, c)) = self.ctrl_out.front() {
            if self.failed(p) {
                self.ctrl_out.pop_front();
                continue;
            }
            let mut m = [0u8; wire::CTRL_MAX];
            // `Closed` carries our next sequence number: every message to the peer before it
            // (over RC too: drained, so completed) is numbered below it.
            let next = self.budget.peer(p).map_or(0, |s| s.seq.peek());
            let len = wire::put_ctrl(&mut m, c, next);
            self.ud_quiet = 0;
            match self.ud.am_send(p, &m[..len], &[]) {
                Ok(SendOutcome::Sent) => {
                    self.totals.ctrl_sent += 1;
                    self.ctrl_out.pop_front();
                }
                Ok(_) => break,
                // The peer failed: verbs-ud reports it through progress.
                Err(_) => {
                    self.ctrl_out.pop_front();
                }
            }
        }
        Ok(())
    }
}
