//! Keepalives: a zero-length RDMA write to connected peers with nothing in flight, in turn, so
//! that a rank waiting only to receive notices a dead peer (`WEFT_VERBS_RC_KEEPALIVE`).

use super::*;

impl VerbsRc {
    /// Probe connected peers with nothing in flight by a zero-length RDMA write: a dead one
    /// fails it with transport retry exceeded.
    pub(super) fn keepalives(&mut self) -> Result<()> {
        let Some(every) = self.keepalive else {
            return Ok(());
        };
        let now = Instant::now();
        if now < self.next_keepalive {
            return Ok(());
        }
        self.next_keepalive = now + every;
        // Probes in flight stay within the completion queue's room for them, starting where
        // the last round stopped, so that every connection is probed in turn. A round the room
        // cut short is followed sooner, so that each of `n` peers is still probed about once
        // per interval (a probe completes in microseconds, freeing its room).
        let n = self.peers.touched();
        for j in 0..n {
            if self.ka_posted >= self.ka_room {
                let share = self.ka_room as f64 / n as f64;
                self.next_keepalive = now + every.mul_f64(share).max(Duration::from_millis(1));
                break;
            }
            let k = (self.ka_next + j) % n;
            let r = self.peers.touched_rank(k) as Rank;
            let p = &self.peers[r as usize];
            if r == self.rank || p.conn != Conn::Up || p.inflight > 0 {
                continue;
            }
            let qp = p.qp.expect("connected peers have a QP");
            self.hca
                .post_send(qp, &[SendWr::write(K_KA | r as u64, &[], 0, 0)])?;
            self.peers[r as usize].inflight += 1;
            self.ka_posted += 1;
            self.stats.keepalives += 1;
            self.ka_next = k + 1;
        }
        Ok(())
    }
}
