//! The connection manager: peers' UD addresses (the address book), `REQ`/`REP` datagrams over
//! the UD QP, a connection started on first use, answered (the higher rank answers crossing
//! requests), resent until answered and failed after `WEFT_VERBS_RC_CONNECT_TIMEOUT`.

use super::*;
use cm_state::{OnCm, OnTimer};

impl VerbsRc {
    /// The connection-manager address `r` published (looked up once).
    pub(super) fn published(&mut self, r: Rank) -> Result<Endpoint> {
        self.book.get(r)
    }

    /// Whether connection-manager datagram `m` is from the rank it names, on that rank's HCA:
    /// it came from the UD QP the rank published (the HCA stamps every UD receive with the
    /// sender's QP number and, in the GRH, its GID, which no sender chooses), and the QP it
    /// offers is on that same HCA. The endpoint a connection is made to is then the
    /// bootstrap's, never one a datagram chose: a forged request cannot point this HCA at
    /// another process (the soft HCA maps the process a GID names).
    pub(super) fn cm_from_published(&mut self, m: &CmMsg, src_qp: u32, grh: Option<&[u8]>) -> bool {
        if m.src >= self.size {
            return false;
        }
        let Ok(e) = self.published(m.src) else {
            return false;
        };
        e.sent(src_qp, grh) && m.ep.gid == e.gid && m.ep.lid == e.lid
    }

    /// The peer's connection-manager address and handle.
    pub(super) fn ud_of(&mut self, r: Rank) -> Result<(verbs::Ah, u32)> {
        let (hca, pd) = (&self.hca, self.pd);
        let (ah, ep) = self.book.handle(r, |ep| hca.create_ah(pd, &ep.ah_attr()))?;
        Ok((ah, ep.qpn))
    }

    pub(super) fn send_cm(&mut self, to: Rank, m: &CmMsg) -> Result<()> {
        let (ah, qpn) = self.ud_of(to)?;
        let Some(i) = self.ud_send.free.pop() else {
            // Every manager send slot is in flight: the resend timer covers a dropped one.
            return Ok(());
        };
        // SAFETY: a free send slot: no send of it is outstanding.
        let b = unsafe { self.ud_send.buf(i) };
        b[..CM_LEN].copy_from_slice(&m.encode());
        let wr = SendWr::send(K_UDS | i as u64, &[self.ud_send.sge(i, CM_LEN)]).to(ah, qpn, QKEY);
        if let Err(e) = self.hca.post_send(self.ud_qp, &[wr]) {
            self.ud_send.free.push(i);
            return Err(e);
        }
        Ok(())
    }

    pub(super) fn my_ep(&self, p: &Peer) -> Endpoint {
        Endpoint::of(
            &*self.hca,
            p.qp.expect("a QP exists once a connection is asked for"),
            p.psn,
        )
    }

    /// Start connecting to `r` (nothing if already under way).
    pub(super) fn start(&mut self, r: Rank) -> Result<()> {
        let i = self.check_rank(r)?;
        if self.peers[i].conn != Conn::Idle {
            return Ok(());
        }
        self.stats.connects += 1;
        let qp = self.new_rc_qp()?;
        self.by_qpn.insert(qp.qpn, r);
        let psn = (qp.qpn.wrapping_mul(2_654_435_761) ^ self.rank) & 0xff_ffff;
        if r == self.rank {
            // Ourselves: a second QP, the two connected to each other here.
            let back = self.new_rc_qp()?;
            self.by_qpn.insert(back.qpn, r);
            let p = self.rc;
            let a = Endpoint::of(&*self.hca, qp, psn);
            let b = Endpoint::of(&*self.hca, back, psn);
            verbs::connect_rc(&*self.hca, qp, psn, &b, &p)?;
            verbs::connect_rc(&*self.hca, back, psn, &a, &p)?;
            self.self_back = Some(back);
            let me = &mut self.peers[i];
            me.qp = Some(qp);
            me.psn = psn;
            me.conn = Conn::Up;
            self.events.push((r, ConnEvent::Connected));
            return self.on_up(r);
        }
        let now = Instant::now();
        let p = &mut self.peers[i];
        p.qp = Some(qp);
        p.psn = psn;
        p.conn = Conn::Requesting {
            first: now,
            next: now + REQ_RESEND,
            wait: REQ_RESEND,
        };
        self.cm_due.push(Reverse((now + REQ_RESEND, r)));
        let m = self.req(r);
        self.send_cm(r, &m)
    }

    pub(super) fn req(&self, r: Rank) -> CmMsg {
        let p = &self.peers[r as usize];
        CmMsg {
            kind: CmKind::Req,
            job: self.job,
            src: self.rank,
            dst: r,
            gen: p.gen,
            ep: self.my_ep(p),
        }
    }

    /// A connection-manager datagram arrived: decided by [`cm_state::on_cm`], carried out
    /// here.
    pub(super) fn on_cm(&mut self, m: CmMsg) -> Result<()> {
        let r = m.src;
        let Some(p) = self.peers.get(r as usize) else {
            return Ok(());
        };
        let answered = p.rep.and(p.remote_qpn);
        let d = cm_state::on_cm(self.rank, self.size, self.job, p.conn, p.gen, answered, &m);
        match d {
            OnCm::Ignore => {}
            OnCm::Stale => self.stats.cm_stale += 1,
            OnCm::Accept => self.accept(r, &m)?,
            OnCm::RepeatRep => {
                if let Some(rep) = self.peers[r as usize].rep {
                    self.send_cm(r, &rep)?;
                }
            }
            OnCm::Complete => {
                let i = r as usize;
                let p = &self.peers[i];
                let qp = p.qp.expect("requesting peers have a QP");
                verbs::connect_rc(&*self.hca, qp, p.psn, &m.ep, &self.rc)?;
                self.peers[i].remote_qpn = Some(m.ep.qpn);
                self.peers[i].conn = Conn::Up;
                self.send_frame(r, FrameKind::Rtu, 0, &[], &[])?;
                self.events.push((r, ConnEvent::Connected));
                self.on_up(r)?;
            }
        }
        Ok(())
    }

    /// Answer `REQ` `m` from `r`: connect a QP to the requester's and say which.
    pub(super) fn accept(&mut self, r: Rank, m: &CmMsg) -> Result<()> {
        let i = r as usize;
        if self.peers[i].qp.is_none() {
            let qp = self.new_rc_qp()?;
            self.by_qpn.insert(qp.qpn, r);
            self.peers[i].qp = Some(qp);
            self.peers[i].psn = (qp.qpn.wrapping_mul(2_654_435_761) ^ self.rank) & 0xff_ffff;
        }
        let p = &self.peers[i];
        let qp = p.qp.expect("just made");
        verbs::connect_rc(&*self.hca, qp, p.psn, &m.ep, &self.rc)?;
        let rep = CmMsg {
            kind: CmKind::Rep,
            job: self.job,
            src: self.rank,
            dst: r,
            gen: m.gen,
            ep: self.my_ep(p),
        };
        self.peers[i].remote_qpn = Some(m.ep.qpn);
        self.peers[i].rep = Some(rep);
        self.peers[i].conn = Conn::Accepted;
        self.send_cm(r, &rep)
    }

    /// Resend unanswered connection requests whose time has come; fail peers that never
    /// answer. Only the due requests are looked at (a heap by time): a process that has
    /// touched thousands of peers pays nothing here for those already connected.
    pub(super) fn cm_timers(&mut self) -> Result<()> {
        let now = Instant::now();
        while let Some(&Reverse((at, r))) = self.cm_due.peek() {
            if at > now {
                break;
            }
            self.cm_due.pop();
            self.stats.cm_checked += 1;
            let conn = self.peers[r as usize].conn;
            let next = match cm_state::on_timer(conn, at, now, self.connect_timeout) {
                OnTimer::Skip => continue,
                OnTimer::Fail => {
                    self.conn_failed(r, WcStatus::Success);
                    continue;
                }
                OnTimer::Resend { conn, due } => (conn, due),
            };
            self.peers[r as usize].conn = next.0;
            self.cm_due.push(Reverse((next.1, r)));
            self.stats.cm_resends += 1;
            let m = self.req(r);
            self.send_cm(r, &m)?;
        }
        Ok(())
    }
}
