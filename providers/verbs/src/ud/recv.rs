//! The receive side: a datagram checked against its sender's published QP and GID, fed to the
//! sender's reliability link, and messages assembled straight from the receive buffers when
//! they are next in order (only packets behind a gap are copied into the link).

use super::*;

impl VerbsUd {
    /// A packet arrived in receive slot `i` (`n` bytes after the GRH). A data packet next in
    /// order, with nothing kept ahead of it, is assembled straight from the receive buffer
    /// (returns the messages that delivers to `sink`); any other packet is copied into its
    /// link to wait for `drain`.
    pub(super) fn on_recv(
        &mut self,
        i: u32,
        n: usize,
        (src_qp, with_grh): (u32, bool),
        now: Instant,
        sink: &mut dyn Sink,
    ) -> usize {
        let mtu = self.cfg.mtu;
        // SAFETY (here and below): the receive of slot `i` completed; the slot is reposted
        // only after `on_recv` returns.
        let b = &unsafe { self.recv.buf(i) }[GRH..GRH + n.min(mtu)];
        let Some(wire::Pkt {
            kind,
            flags,
            hlen,
            src,
            psn,
            ack,
            total,
        }) = wire::decode(b, self.size, MAX_HDR, MAX_PAYLOAD)
        else {
            self.stats.malformed += 1;
            return 0;
        };
        // SAFETY: as above (the GRH in front of the packet; copied: `sent_by` needs `self`).
        let grh: Option<[u8; GRH]> = with_grh
            .then(|| unsafe { self.recv.bytes(i, GRH) }.try_into().ok())
            .flatten();
        if !self.sent_by(src, src_qp, grh.as_ref().map(|g| &g[..])) {
            self.stats.spoofed += 1;
            return 0;
        }
        let p = &mut self.peers[src as usize];
        if p.failed {
            return 0;
        }
        self.stats.packets_recv += 1;
        let header = Header {
            psn: (kind == KIND_DATA).then_some(psn),
            ack,
        };
        if kind == KIND_DATA
            && Self::link_of(p, src, &self.cfg, &mut self.active, &mut self.busy)
                .on_next_in_order(now, header)
        {
            // Next in order with nothing waiting: straight from the receive buffer (what
            // `drain` does with a packet the link kept).
            // SAFETY: as above.
            let body = &unsafe { self.recv.buf(i) }[GRH + PKT..GRH + n.min(mtu)];
            let head = Head { flags, hlen, total };
            return Self::take(
                &mut p.rx,
                &mut self.zin,
                &mut self.stats,
                src,
                head,
                body,
                sink,
            );
        }
        // The engine keeps the packet (flags, lengths and bytes) until it is next in order.
        // SAFETY: as above.
        let b = &unsafe { self.recv.buf(i) }[GRH..GRH + n.min(mtu)];
        let spare = &mut self.spare;
        let payload = (kind == KIND_DATA).then(|| {
            let mut v = spare.pop().unwrap_or_default();
            v.clear();
            v.push(flags);
            v.extend_from_slice(&b[2..4]);
            v.extend_from_slice(&b[16..20]);
            v.extend_from_slice(&b[PKT..]);
            v
        });
        let link = self.link(src);
        link.on_packet(now, header, payload);
        0
    }

    /// Deliver `r`'s packets that are next in order, and free the send slots it acknowledged.
    pub(super) fn drain(&mut self, r: Rank, sink: &mut dyn Sink) -> usize {
        let i = r as usize;
        let mut n = 0;
        let peer = &mut self.peers[i];
        loop {
            let Some(link) = peer.link.as_mut() else {
                return n;
            };
            let Some(p) = link.poll_deliver() else {
                break;
            };
            let head = Head {
                flags: p[0],
                hlen: get_u16(&p[1..3]) as usize,
                total: get_u32(&p[3..7]),
            };
            let rx = &mut peer.rx;
            n += Self::take(rx, &mut self.zin, &mut self.stats, r, head, &p[7..], sink);
            // The packet's buffer serves a later arrival (no allocation per packet).
            if self.spare.len() < SPARE {
                self.spare.push(p);
            }
        }
        while let Some(slot) = self.peers[i].link.as_mut().and_then(|l| l.poll_acked()) {
            self.send_acked[slot as usize] = true;
            self.maybe_free(slot);
        }
        n
    }

    /// `r`'s next data packet in order, from the receive buffer or from its link: a
    /// zero-copy control message waits in `zin`, a probe is dropped, anything else goes to
    /// the message being assembled. Returns the messages delivered to `sink`. Inlined: out of
    /// line it cost measurable 8-byte latency (docs/history/benchmarks-notebook.md,
    /// "Measurements behind code decisions").
    #[inline]
    pub(super) fn take(
        rx: &mut Rx,
        zin: &mut Vec<(Rank, Vec<u8>)>,
        stats: &mut Stats,
        r: Rank,
        head: Head,
        body: &[u8],
        sink: &mut dyn Sink,
    ) -> usize {
        if head.flags & F_CTRL != 0 {
            zin.push((r, body.to_vec()));
            0
        } else if head.flags & F_PING != 0 {
            0
        } else {
            Self::assemble(rx, stats, r, head, body, sink)
        }
    }

    /// Put `r`'s next packet in order (`body`, with its flags and lengths) into the message
    /// being assembled; deliver a message it completes. Returns the messages delivered.
    pub(super) fn assemble(
        rx: &mut Rx,
        stats: &mut Stats,
        r: Rank,
        head: Head,
        body: &[u8],
        sink: &mut dyn Sink,
    ) -> usize {
        let Head { flags, hlen, total } = head;
        if flags & F_FIRST != 0 {
            if body.len() < hlen || rx.active {
                stats.malformed += 1;
                rx.active = false;
                return 0;
            }
            if flags & F_LAST != 0 {
                if body.len() - hlen != total as usize {
                    stats.malformed += 1;
                    return 0;
                }
                stats.am_recv += 1;
                sink.am(r, &body[..hlen], &body[hlen..]);
                return 1;
            }
            rx.active = true;
            rx.hlen = hlen;
            rx.total = total as usize;
            rx.data.clear();
            rx.data.extend_from_slice(body);
            return 0;
        }
        if !rx.active {
            stats.malformed += 1;
            return 0;
        }
        rx.data.extend_from_slice(body);
        if rx.data.len() > rx.hlen + rx.total {
            stats.malformed += 1;
            rx.active = false;
            return 0;
        }
        if flags & F_LAST != 0 {
            rx.active = false;
            if rx.data.len() != rx.hlen + rx.total {
                stats.malformed += 1;
                return 0;
            }
            stats.am_recv += 1;
            sink.am(r, &rx.data[..rx.hlen], &rx.data[rx.hlen..]);
            return 1;
        }
        0
    }
}
