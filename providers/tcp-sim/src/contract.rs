//! `TcpSim` as a weft provider: the contract's entry points and opening by name.

use super::*;

impl Provider for TcpSim {
    fn name(&self) -> &str {
        "tcp-sim"
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn rank(&self) -> Rank {
        self.rank
    }
    fn size(&self) -> u32 {
        self.size
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let total: usize = payload.iter().map(|s| s.len()).sum();
        if header.len() > MAX_HEADER || total > self.cfg.chunk {
            return Err(Error::invalid(format!(
                "tcp-sim frame of {}+{total} bytes exceeds {MAX_HEADER}+{}",
                header.len(),
                self.cfg.chunk
            )));
        }
        if dest >= self.size {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: dest as i64,
                size: self.size,
            }));
        }
        if dest == self.rank {
            let mut d = Vec::with_capacity(total);
            for s in payload {
                d.extend_from_slice(s);
            }
            self.selfq.push_back((header.to_vec(), d));
            return Ok(SendOutcome::Sent);
        }
        let fh = FrameHeader {
            kind: K_AM,
            hdr_len: header.len(),
            payload_len: total,
        }
        .encode();
        let flen = FRAME_HDR + header.len() + total;
        let state = self.peers[dest as usize].state;
        if state == State::Failed {
            return Err(Error::peer_failed(dest, "connection lost"));
        }
        let mut written = 0;
        if let (State::Established(slot), None) = (state, &self.sim) {
            // Frames queued earlier go first; when they are all out, this one can go straight.
            if !self.peers[dest as usize].outq.is_empty() {
                self.flush_peer(dest, slot, None);
                if self.peers[dest as usize].state == State::Failed {
                    return Err(Error::peer_failed(dest, "connection lost"));
                }
            }
        }
        let large = total >= COPY_MAX;
        if let (State::Established(slot), true, None) =
            (state, self.peers[dest as usize].outq.is_empty(), &self.sim)
        {
            // Straight from the caller's buffers: one writev.
            let mut iov: smallvec::SmallVec<[IoSlice<'_>; 8]> = smallvec::SmallVec::new();
            iov.push(IoSlice::new(&fh));
            iov.push(IoSlice::new(header));
            iov.extend(payload.iter().map(|s| IoSlice::new(s)));
            let c = self.conns[slot]
                .as_mut()
                .expect("established connection exists");
            let res = if flen <= SMALL_FRAME {
                // A small frame costs less as one contiguous `send` than as a writev.
                let mut one = [0u8; SMALL_FRAME];
                let mut at = 0;
                for s in &iov {
                    one[at..at + s.len()].copy_from_slice(s);
                    at += s.len();
                }
                c.stream.write(&one[..flen])
            } else {
                c.stream.write_vectored(&iov)
            };
            match res {
                Ok(n) if n == flen => return Ok(SendOutcome::Sent),
                Ok(n) => written = n,
                // A full socket: a large payload stays with the caller (it retries after
                // `progress`) rather than being copied here.
                Err(e) if would_block(&e) && large => return Ok(SendOutcome::Busy),
                Err(e) if would_block(&e) => {}
                Err(e) => {
                    let w = format!("connection error: {e}");
                    self.fail_peer(dest, w.clone());
                    return Err(Error::peer_failed(dest, w));
                }
            }
        }
        let p = &mut self.peers[dest as usize];
        // When simulating, the queue also holds the frames on the simulated wire.
        let limit = self.cfg.queue + self.sim.as_ref().map_or(0, |s| s.in_flight);
        if written == 0
            && !p.outq.is_empty()
            && (p.out_bytes + flen > limit || (large && self.sim.is_none()))
        {
            return Ok(SendOutcome::Busy);
        }
        // Queue (the rest of) the frame.
        let mut data = self.spare.take();
        data.reserve(flen);
        data.extend_from_slice(&fh);
        data.extend_from_slice(header);
        for s in payload {
            data.extend_from_slice(s);
        }
        let due = self.sim.as_mut().map(|sim| sim.due(p, flen));
        p.out_bytes += flen;
        p.outq.push_back(OutFrame {
            data,
            off: written,
            due,
        });
        if state == State::Idle {
            self.connect(dest)?;
        }
        if !self.busy_peers.contains(&dest) {
            self.busy_peers.push(dest);
        }
        Ok(SendOutcome::Sent)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = 0;
        while let Some((h, d)) = self.selfq.pop_front() {
            sink.am(self.rank, &h, &d);
            n += 1;
        }
        self.polls = self.polls.wrapping_add(1);
        if self.direct_mode() {
            let mut i = 0;
            while i < self.direct.len() {
                let slot = self.direct[i];
                n += self.on_readable(slot, sink);
                i += 1;
            }
            if !self.busy_peers.is_empty() {
                n += self.flush();
            }
            for (r, why) in self.failures.drain(..) {
                sink.peer_failed(r, &why);
                n += 1;
            }
            return Ok(n);
        }
        let mut events = std::mem::replace(&mut self.events, Events::with_capacity(0));
        match self.poll.poll(&mut events, Some(Duration::ZERO)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                self.events = events;
                return Err(Error::io("polling sockets", e));
            }
        }
        for ev in events.iter() {
            let t = ev.token();
            if t == LISTENER {
                self.accept_all();
                continue;
            }
            if ev.is_writable() || ev.is_error() {
                self.on_writable(t.0);
            }
            if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                n += self.on_readable(t.0, sink);
            }
        }
        self.events = events;
        if !self.busy_peers.is_empty() {
            n += self.flush();
        }
        for (r, why) in self.failures.drain(..) {
            sink.peer_failed(r, &why);
            n += 1;
        }
        Ok(n)
    }

    fn close(&mut self) -> Result<()> {
        // Write out what is queued (bounded), then let the sockets close.
        let t0 = Instant::now();
        while !self.busy_peers.is_empty() && t0.elapsed() < Duration::from_secs(10) {
            self.flush();
            // Keep handshakes moving for peers we have not connected to yet.
            let mut events = std::mem::replace(&mut self.events, Events::with_capacity(0));
            let _ = self.poll.poll(&mut events, Some(Duration::from_millis(1)));
            for ev in events.iter() {
                let t = ev.token();
                if t == LISTENER {
                    self.accept_all();
                    continue;
                }
                if ev.is_writable() {
                    self.on_writable(t.0);
                }
                if ev.is_readable() {
                    // Only handshakes matter now; messages arriving after finalize are dropped.
                    self.on_readable(t.0, &mut Discard::default());
                }
            }
            self.events = events;
        }
        Ok(())
    }
}

impl StaticProvider for TcpSim {
    const NAME: &'static str = "tcp-sim";

    fn probe(_ctx: &ProbeContext) -> std::result::Result<(), String> {
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, Config::from_env()?)
    }

    fn static_caps() -> Result<Caps> {
        Ok(Config::from_env()?.caps())
    }
}
