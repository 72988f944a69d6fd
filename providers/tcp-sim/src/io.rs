//! The streams' I/O: frames read as they arrive (`on_readable`), queued frames written while
//! a socket takes them (`on_writable`, `flush`).

use super::*;

impl TcpSim {
    pub(crate) fn on_writable(&mut self, slot: usize) {
        let Some(c) = self.conns[slot].as_mut() else {
            return;
        };
        if let Role::Outgoing { hello: false } = c.role {
            let Some(r) = c.peer else { return };
            match c.stream.take_error() {
                Ok(Some(e)) | Err(e) => {
                    let a = self.addrs[r as usize];
                    self.fail_peer(r, format!("cannot connect to {a}: {e}"));
                    return;
                }
                Ok(None) => {}
            }
            if c.stream.peer_addr().is_err() {
                return; // still connecting
            }
            let mut hello = Vec::with_capacity(4);
            hello.extend_from_slice(&self.rank.to_le_bytes());
            match Self::write_ctrl(&mut c.stream, K_HELLO, &hello) {
                Ok(()) => c.role = Role::Outgoing { hello: true },
                Err(e) => self.fail_peer(r, format!("connection lost during the handshake: {e}")),
            }
        }
    }

    pub(crate) fn mark_busy(&mut self, r: Rank) {
        if !self.peers[r as usize].outq.is_empty() && !self.busy_peers.contains(&r) {
            self.busy_peers.push(r);
        }
    }

    /// Read everything available on a connection and deliver its frames.
    pub(crate) fn on_readable(&mut self, slot: usize, sink: &mut dyn Sink) -> usize {
        let mut delivered = 0;
        'read: loop {
            let Some(c) = self.conns[slot].as_mut() else {
                return delivered;
            };
            if c.direct.is_some() {
                match c.read_direct(sink) {
                    Ok(true) => {
                        delivered += 1;
                        c.expect_large = true;
                        continue;
                    }
                    Ok(false) => return delivered,
                    Err(why) => {
                        self.closed(slot, why);
                        return delivered;
                    }
                }
            }
            if c.end == c.rx.len() {
                // Compact: the partial frame at the front moves to the start.
                c.rx.copy_within(c.start..c.end, 0);
                c.end -= c.start;
                c.start = 0;
            }
            let mut room = c.rx.len() - c.end;
            if c.expect_large && c.start == c.end {
                room = room.min(FRAME_HDR + MAX_HEADER);
            }
            let n = match c.stream.read(&mut c.rx[c.end..c.end + room]) {
                Ok(0) => {
                    self.closed(slot, "connection closed (EOF)".into());
                    return delivered;
                }
                Ok(n) => n,
                Err(e) if would_block(&e) => return delivered,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.closed(slot, format!("connection error: {e}"));
                    return delivered;
                }
            };
            c.end += n;
            // A short read drained the socket: no need for another read that returns EAGAIN
            // (new data raises a new edge for epoll, and direct polling reads again anyway).
            let drained = n < room;
            loop {
                let Some(c) = self.conns[slot].as_mut() else {
                    return delivered;
                };
                let h = match decode_header(&c.rx[c.start..c.end], self.limits) {
                    Ok(Some(h)) => h,
                    Ok(None) => break,
                    Err(e) => {
                        self.closed(slot, format!("malformed frame: {e}"));
                        return delivered;
                    }
                };
                let f = c.start + FRAME_HDR;
                let (hs, ps) = (f, f + h.hdr_len);
                let pe = ps + h.payload_len;
                if c.end < pe {
                    // Part of a frame. A large active-message payload may go straight to its
                    // destination instead of waiting for all of it in `rx`.
                    let est = c
                        .peer
                        .filter(|&r| self.peers[r as usize].state == State::Established(slot));
                    if let (K_AM, false, true, true, Some(r)) = (
                        h.kind,
                        c.buffered || !self.cfg.direct,
                        h.payload_len >= DIRECT_MIN,
                        c.end >= ps,
                        est,
                    ) {
                        let pre = c.end - ps;
                        match sink.am_target(r, &c.rx[hs..ps], 0, h.payload_len) {
                            Some(p) => {
                                // SAFETY: `p` is valid for `payload_len >= pre` bytes until our
                                // next call into the sink (`am_placed` below); `rx` is ours.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        c.rx[ps..].as_ptr(),
                                        p.as_ptr(),
                                        pre,
                                    )
                                };
                                if pre > 0 {
                                    sink.am_placed(r, &c.rx[hs..ps], 0, pre);
                                }
                                let mut hdr = [0u8; MAX_HEADER];
                                hdr[..h.hdr_len].copy_from_slice(&c.rx[hs..ps]);
                                c.direct = Some(Direct {
                                    src: r,
                                    hdr,
                                    hdr_len: h.hdr_len,
                                    len: h.payload_len,
                                    done: pre,
                                    discard: false,
                                });
                                c.start = 0;
                                c.end = 0;
                                continue 'read;
                            }
                            None => c.buffered = true,
                        }
                    }
                    break;
                }
                c.buffered = false;
                // A control frame (CTS, SACK: no payload) between two large frames keeps the
                // header-only reads on; a small data frame ends them.
                if h.payload_len > 0 {
                    c.expect_large = false;
                }
                c.start += h.total();
                match h.kind {
                    K_AM => match c.peer {
                        Some(r) if self.peers[r as usize].state == State::Established(slot) => {
                            sink.am(r, &c.rx[hs..ps], &c.rx[ps..pe]);
                            delivered += 1;
                        }
                        _ => {
                            self.closed(slot, "data before the handshake".into());
                            return delivered;
                        }
                    },
                    K_HELLO => {
                        let from = (h.payload_len == 4 && matches!(c.role, Role::Incoming))
                            .then(|| u32::from_le_bytes(c.rx[ps..ps + 4].try_into().unwrap()));
                        match from {
                            Some(r) => self.on_hello(slot, r),
                            None => {
                                self.closed(slot, "bad HELLO".into());
                                return delivered;
                            }
                        }
                    }
                    _ => {
                        let ok = h.payload_len == 1 && c.rx[ps] == 1;
                        self.on_ack(slot, ok);
                    }
                }
            }
            if drained {
                return delivered;
            }
        }
    }

    /// Write queued frames that are due. Returns frames completed.
    pub(crate) fn flush(&mut self) -> usize {
        let mut done = 0;
        let now = self.sim.as_ref().map(|_| Instant::now());
        let mut i = 0;
        while i < self.busy_peers.len() {
            let r = self.busy_peers[i];
            match self.peers[r as usize].state {
                State::Established(slot) => done += self.flush_peer(r, slot, now),
                State::Failed => {}
                _ => {
                    i += 1;
                    continue;
                }
            }
            if self.peers[r as usize].outq.is_empty() {
                self.busy_peers.swap_remove(i);
            } else {
                i += 1;
            }
        }
        done
    }

    /// Write `r`'s queued frames (those due by `now` when simulating) on its connection `slot`
    /// until the socket is full; a write error fails the peer. Returns frames completed.
    pub(crate) fn flush_peer(&mut self, r: Rank, slot: usize, now: Option<Instant>) -> usize {
        let mut done = 0;
        let mut failed = None;
        let p = &mut self.peers[r as usize];
        let c = self.conns[slot]
            .as_mut()
            .expect("established connection exists");
        while let Some(f) = p.outq.front_mut() {
            if let (Some(d), Some(n)) = (f.due, now) {
                if d > n {
                    break;
                }
            }
            match c.stream.write(&f.data[f.off..]) {
                Ok(n) => {
                    f.off += n;
                    if f.off == f.data.len() {
                        p.out_bytes -= f.data.len();
                        if let Some(f) = p.outq.pop_front() {
                            self.spare.give(f.data);
                        }
                        done += 1;
                    }
                }
                Err(e) if would_block(&e) => break,
                Err(e) => {
                    failed = Some(format!("connection error: {e}"));
                    break;
                }
            }
        }
        if let Some(w) = failed {
            self.fail_peer(r, w);
        }
        done
    }
}
