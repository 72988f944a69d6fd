//! Connections: one TCP stream per peer, made on first use (the lower rank connects, `Hello`
//! and `Ack` name the ranks), accepted, closed, probed while unconnected, and the direct reads
//! of large frames into the receiver's buffer.

use super::*;

pub(crate) enum Role {
    /// We connected to `peer`; `hello` once our HELLO is written.
    Outgoing { hello: bool },
    /// Accepted; the peer is known after its HELLO.
    Incoming,
}

pub(crate) struct Conn {
    pub(crate) stream: TcpStream,
    pub(crate) peer: Option<Rank>,
    pub(crate) role: Role,
    pub(crate) rx: Vec<u8>,
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// A payload being read from the socket straight into its destination.
    pub(crate) direct: Option<Direct>,
    /// The core declined direct placement for the frame at `start`: wait for all of it.
    pub(crate) buffered: bool,
    /// A frame was placed directly and no frame with a payload came since, so the next is
    /// likely another large one: read only up to its header, leaving its payload in the socket
    /// for direct placement.
    pub(crate) expect_large: bool,
}

/// Rate at which a simulated link without `WEFT_TCP_SIM_BW_MBPS` is assumed to carry data when
/// sizing what may be in flight on it (loopback TCP moves 3–5 GB/s here).
pub(crate) const SIM_FAST_LINK: f64 = 10e9;

/// Frames up to this long are gathered on the stack and written with one `send`.
pub(crate) const SMALL_FRAME: usize = 256;

/// Payloads at least this long are offered for direct placement when they arrive in pieces.
pub(crate) const DIRECT_MIN: usize = 16 * 1024;

/// Without simulation, a payload at least this long that finds the socket full (or frames
/// queued before it) is refused with `Busy` instead of being copied into the queue: the core
/// keeps it and retries, so the bytes are copied once, by the kernel. Shorter frames are queued,
/// which lets small sends complete at once.
pub(crate) const COPY_MAX: usize = 16 * 1024;

/// An active message whose payload is read from the socket into the memory the core named
/// (`Sink::am_target`), skipping the copy through `rx`.
pub(crate) struct Direct {
    pub(crate) src: Rank,
    pub(crate) hdr: [u8; MAX_HEADER],
    pub(crate) hdr_len: usize,
    pub(crate) len: usize,
    pub(crate) done: usize,
    /// The destination went away (its receive failed): read and drop the rest.
    pub(crate) discard: bool,
}

impl Conn {
    /// Continue a direct payload: `Ok(true)` when it is complete, `Ok(false)` when the socket
    /// has nothing more for now, `Err` when the connection broke.
    pub(crate) fn read_direct(&mut self, sink: &mut dyn Sink) -> std::result::Result<bool, String> {
        let Conn {
            stream, rx, direct, ..
        } = self;
        let Some(d) = direct.as_mut() else {
            return Ok(true);
        };
        loop {
            if d.done == d.len {
                *direct = None;
                return Ok(true);
            }
            let want = d.len - d.done;
            let hdr = &d.hdr[..d.hdr_len];
            let target = if d.discard {
                None
            } else {
                sink.am_target(d.src, hdr, d.done, want)
            };
            let res = match target {
                Some(p) => {
                    // SAFETY: the sink made `p` valid for writes of `want` bytes until our next
                    // call into it, which is the `am_placed` below; the bytes are initialised
                    // (the receive buffer is a borrowed slice of plain data).
                    let buf = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), want) };
                    stream.read(buf)
                }
                None => {
                    d.discard = true;
                    let m = want.min(rx.len());
                    stream.read(&mut rx[..m])
                }
            };
            match res {
                Ok(0) => return Err("connection closed (EOF)".into()),
                Ok(n) => {
                    if target.is_some() {
                        sink.am_placed(d.src, hdr, d.done, n);
                    }
                    d.done += n;
                }
                Err(e) if would_block(&e) => return Ok(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("connection error: {e}")),
            }
        }
    }
}

impl TcpSim {
    pub(crate) fn add_conn(
        &mut self,
        mut stream: TcpStream,
        peer: Option<Rank>,
        role: Role,
    ) -> Result<usize> {
        let slot = match self.conns.iter().position(|c| c.is_none()) {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.conns.len() - 1
            }
        };
        let _ = stream.set_nodelay(true);
        self.poll
            .registry()
            .register(
                &mut stream,
                Token(slot),
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|e| Error::io("registering a connection", e))?;
        let cap = self.rx_capacity();
        self.conns[slot] = Some(Conn {
            stream,
            peer,
            role,
            rx: vec![0u8; cap],
            start: 0,
            end: 0,
            direct: None,
            buffered: false,
            expect_large: false,
        });
        Ok(slot)
    }

    pub(crate) fn drop_conn(&mut self, slot: usize) {
        if let Some(mut c) = self.conns.get_mut(slot).and_then(|c| c.take()) {
            let _ = self.poll.registry().deregister(&mut c.stream);
        }
        self.direct.retain(|s| *s != slot);
    }

    pub(crate) fn established(&mut self, r: Rank, slot: usize) {
        self.peers[r as usize].state = State::Established(slot);
        if !self.direct.contains(&slot) {
            self.direct.push(slot);
        }
        self.mark_busy(r);
    }

    pub(crate) fn connect(&mut self, r: Rank) -> Result<()> {
        let addr = self.addrs[r as usize];
        match TcpStream::connect(addr) {
            Ok(s) => {
                let slot = self.add_conn(s, Some(r), Role::Outgoing { hello: false })?;
                self.peers[r as usize].state = State::Connecting(slot);
            }
            Err(e) => self.fail_peer(r, format!("cannot connect to {addr}: {e}")),
        }
        Ok(())
    }

    /// Write a small control frame on a fresh connection (retries briefly on WouldBlock).
    pub(crate) fn write_ctrl(
        stream: &mut TcpStream,
        kind: u8,
        payload: &[u8],
    ) -> std::io::Result<()> {
        let h = FrameHeader {
            kind,
            hdr_len: 0,
            payload_len: payload.len(),
        }
        .encode();
        let mut buf = h.to_vec();
        buf.extend_from_slice(payload);
        let mut off = 0;
        let t0 = Instant::now();
        while off < buf.len() {
            match stream.write(&buf[off..]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => off += n,
                Err(e) if would_block(&e) => {
                    if t0.elapsed() > Duration::from_secs(5) {
                        return Err(std::io::ErrorKind::TimedOut.into());
                    }
                    std::thread::yield_now();
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    pub(crate) fn on_hello(&mut self, slot: usize, from: Rank) {
        if from >= self.size || from == self.rank {
            tracing::warn!(from, "tcp-sim: HELLO with a bad rank; closing");
            self.drop_conn(slot);
            return;
        }
        let me = self.rank;
        let state = self.peers[from as usize].state;
        let accept = match state {
            State::Idle | State::WaitIncoming => true,
            // Both connected at once: the lower rank's connection wins.
            State::Connecting(_) => from < me,
            State::Established(_) | State::Failed => false,
        };
        let Some(c) = self.conns[slot].as_mut() else {
            return;
        };
        let r = Self::write_ctrl(&mut c.stream, K_ACK, &[accept as u8]);
        if !accept || r.is_err() {
            self.drop_conn(slot);
            return;
        }
        c.peer = Some(from);
        if let State::Connecting(old) = state {
            self.drop_conn(old);
        }
        self.established(from, slot);
    }

    pub(crate) fn on_ack(&mut self, slot: usize, ok: bool) {
        let Some(r) = self.conns[slot].as_ref().and_then(|c| c.peer) else {
            self.drop_conn(slot);
            return;
        };
        if self.peers[r as usize].state != State::Connecting(slot) {
            self.drop_conn(slot);
            return;
        }
        if ok {
            self.established(r, slot);
        } else {
            self.drop_conn(slot);
            self.peers[r as usize].state = State::WaitIncoming;
        }
    }

    pub(crate) fn closed(&mut self, slot: usize, why: String) {
        let conn = self.conns[slot].as_ref().map(|c| (c.peer, &c.role));
        match conn {
            Some((Some(r), _))
                if matches!(self.peers[r as usize].state,
                    State::Established(s) | State::Connecting(s) if s == slot) =>
            {
                self.fail_peer(r, why)
            }
            Some((None, Role::Incoming)) => {
                // A peer connected and went away before saying who it is: it may have died
                // while connecting. Connect to every peer we have no connection with; a dead
                // one refuses (its listener is gone) and fails, a live one gets its lazy
                // connection a little early.
                self.drop_conn(slot);
                self.probe_unconnected();
            }
            _ => self.drop_conn(slot),
        }
    }

    /// Connect to every peer with no connection and none under way (see `closed`).
    pub(crate) fn probe_unconnected(&mut self) {
        for r in 0..self.size {
            if r == self.rank {
                continue;
            }
            if matches!(
                self.peers[r as usize].state,
                State::Idle | State::WaitIncoming
            ) {
                tracing::debug!(peer = r, "tcp-sim: probing after an anonymous disconnect");
                if let Err(e) = self.connect(r) {
                    tracing::warn!("tcp-sim: probing rank {r}: {e}");
                }
            }
        }
    }

    pub(crate) fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    if let Err(e) = self.add_conn(s, None, Role::Incoming) {
                        tracing::warn!("tcp-sim: {e}");
                    }
                }
                Err(e) if would_block(&e) => return,
                Err(e) => {
                    tracing::warn!("tcp-sim: accept: {e}");
                    return;
                }
            }
        }
    }
}
