//! verbs-ud's configuration: its parameters (`WEFT_VERBS_UD_*`), read and checked at open into
//! a `Config`, and what follows from them (the packet size fitted to the port, the largest
//! payload, `Caps`, the reliability engine's settings).

use super::*;

weft_provider::param!(pub(super) MTU: Uint[256, 4096] check(weft_provider::param::checks::power_of_two) = "verbs", "UD_MTU", "2048",
    "verbs-ud: bytes of one packet (the path MTU; 256 to 4096, a power of two, at most the port's active MTU; the default is lowered to it)");
weft_provider::param!(pub(super) WINDOW: Uint[1, 4096] = "verbs", "UD_WINDOW", "128",
    "verbs-ud: packets in flight to one peer before its acknowledgements (1 to 4096); one active message is at most what this many packets hold");
weft_provider::param!(pub(super) RECVS: Uint[16, 16384] = "verbs", "UD_RECVS", "512",
    "verbs-ud: receive buffers of the one UD queue pair, shared by every peer (16 to 16384)");
weft_provider::param!(pub(super) SEND_BUFS: Uint[16, 65536] = "verbs", "UD_SEND_BUFS", "1024",
    "verbs-ud: send buffers shared by every peer; a packet holds one until acknowledged (16 to 65536)");
weft_provider::param!(pub(super) TIMEOUT: Seconds[1e-3, 1e9] = "verbs", "UD_TIMEOUT", "30",
    "verbs-ud: seconds a peer that owes acknowledgements may stay silent before it is failed (UCX ud: 30; 0.001 to 10^9)");
weft_provider::param!(pub(super) ZCOPY_MIN: Size = "verbs", "UD_ZCOPY_MIN", "8K",
    "verbs-ud: messages of this many bytes or more that go by rendezvous are received in place (UD zero-copy); smaller ones are copied out of the shared receive buffers");
weft_provider::param!(pub(super) ZCOPY_QPS: Uint[0, 64] = "verbs", "UD_ZCOPY_QPS", "4",
    "verbs-ud: UD queue pairs kept for zero-copy receives, so that many large receives at once (0: no zero-copy; 0 to 64)");
weft_provider::param!(pub(super) ACK_DELAY: Float[0, 1e6] = "verbs", "UD_ACK_DELAY_US", "100",
    "verbs-ud: µs at most a received packet waits for data going back to carry its acknowledgement before one goes alone; retransmission timeouts include it (raise it for lossless runs with more ranks than cores); 0 to 10^6");
weft_provider::param!(pub(super) KEEPALIVE: Seconds = "verbs", "UD_KEEPALIVE", "2",
    "verbs-ud: seconds between probes of peers we talk to that have nothing unacknowledged, so that a dead one is noticed (0: never)");
weft_provider::param!(pub(super) KEEPALIVE_PEERS: Uint[1, 1 << 20] = "verbs", "UD_KEEPALIVE_PEERS", "128",
    "verbs-ud: peers looked at per keepalive round at most, in turn from where the last round stopped, so that a round costs the same at any job size; a dead peer among N we talk to is probed within N/this rounds (UCX: UCX_KEEPALIVE_NUM_EPS, 128; 1 to 1048576)");

pub(super) struct Config {
    pub(super) mtu: usize,
    /// `WEFT_VERBS_UD_MTU` was given (else `mtu` is the default, lowered to the port's).
    pub(super) mtu_set: bool,
    pub(super) window: u32,
    pub(super) recvs: usize,
    pub(super) send_bufs: usize,
    pub(super) timeout: Duration,
    pub(super) keepalive: Option<Duration>,
    /// Peers looked at per keepalive round at most.
    pub(super) keepalive_peers: usize,
    pub(super) ack_delay: Duration,
    pub(super) zcopy_min: usize,
    pub(super) zcopy_qps: usize,
}

impl Config {
    pub(super) fn from_env() -> Result<Config> {
        // Every range is in the parameter's declaration.
        Ok(Config {
            keepalive: KEEPALIVE.get_seconds(true)?,
            keepalive_peers: KEEPALIVE_PEERS.get_u64()? as usize,
            ack_delay: Duration::from_nanos((ACK_DELAY.get_f64()? * 1e3) as u64),
            mtu: MTU.get_u64()? as usize,
            mtu_set: MTU.is_set(),
            window: WINDOW.get_u64()? as u32,
            recvs: RECVS.get_u64()? as usize,
            send_bufs: SEND_BUFS.get_u64()? as usize,
            timeout: TIMEOUT.get_duration()?,
            zcopy_min: ZCOPY_MIN.get_size()?.max(1),
            zcopy_qps: ZCOPY_QPS.get_u64()? as usize,
        })
    }

    /// Fit the packet size to the port: a datagram larger than the port's active MTU is never
    /// delivered (the HCA fails its send), so a `WEFT_VERBS_UD_MTU` above it is refused here
    /// rather than left to end in a silent peer; the default is lowered to it (as MVAPICH2's
    /// `MV2_UD_MTU` defaults to the port's active MTU).
    pub(super) fn fit_mtu(&mut self, active: usize) -> Result<()> {
        if self.mtu <= active {
            return Ok(());
        }
        if self.mtu_set {
            return Err(Error::invalid(format!(
                "WEFT_VERBS_UD_MTU={} is above the port's active MTU ({active} bytes): no \
                 datagram that large can be delivered (on the soft HCA, raise \
                 WEFT_VERBS_SOFT_MTU)",
                self.mtu
            )));
        }
        self.mtu = active;
        Ok(())
    }

    /// The largest payload one active message may carry: `am_send` takes a message only when
    /// the peer's send window and the shared send buffers have room for all its packets at
    /// once, so a message of more packets than either holds could never go.
    pub(super) fn max_payload(&self) -> usize {
        let packets = (self.window as usize).min(self.send_bufs);
        (packets * (self.mtu - PKT))
            .saturating_sub(MAX_HDR)
            .min(MAX_PAYLOAD)
    }

    pub(super) fn caps(&self) -> Caps {
        let max_payload = self.max_payload();
        let mut c = Caps::am_only(MAX_HDR, max_payload, 16);
        // Aptus sends up to 8 KiB by UD-SR; larger messages by rendezvous.
        c.eager_limit = max_payload.min(8 << 10);
        c.spans_hosts = true;
        if self.zcopy_qps > 0 {
            // The write rendezvous only: a receive buffer posted to a UD QP (no windows).
            c.rma = Some(RmaCaps {
                write: true,
                max_iov: 1,
                user_memory: true,
                completion: CompletionLevel::Delivery,
                rndv_only: true,
                ..RmaCaps::default()
            });
            c.mr_local = true;
            c.per_peer = true;
        }
        c
    }

    pub(super) fn link(&self) -> reliable::Config {
        reliable::Config {
            window: self.window,
            peer_timeout: self.timeout,
            ack_delay: self.ack_delay,
            ..reliable::Config::default()
        }
    }
}
