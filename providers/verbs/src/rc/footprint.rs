//! What one process and one peer of verbs-rc cost (`footprint()`, for `weft info`), measured
//! on a soft HCA of its own.

use super::*;

/// What verbs-rc costs in memory with the current parameters, measured with the HCA's own
/// accounting (the soft HCA counts queue entries and registrations exactly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// HCA memory of one connected peer: its RC queue pair and send queue.
    pub per_peer: u64,
    /// Per process, whatever the number of peers: the completion queue, the shared receive
    /// queue and the connection manager's UD queue pair (HCA side) ...
    pub hca_shared: u64,
    /// ... and the registered receive and send buffers (provider side).
    pub buffers: u64,
    /// Eager-ring memory of one peer, both directions (the ring a peer writes here and the
    /// mirror of ours): every connected peer with basic, piggyback and pipeline; with
    /// fastpath only peers past the threshold, at most `WEFT_VERBS_RC_FP_PEERS`.
    pub eager_per_peer: u64,
    /// The eager design in force, and when its rings exist.
    pub eager: &'static str,
}

/// Measure [`Footprint`] on the device `WEFT_VERBS_DEVICE` names.
pub fn footprint() -> Result<Footprint> {
    let cfg = Config::from_env()?;
    let hca = verbs::open_default()?;
    let pd = hca.alloc_pd()?;
    let a0 = hca.accounting().total();
    let cq = hca.create_cq(cfg.cqe(1, hca.attr()))?;
    let srq = hca.create_srq(pd, cfg.srq as u32, 1)?;
    let ud = hca.create_qp(pd, &ud_init(cq))?;
    let a1 = hca.accounting().total();
    let max_sge = (hca.attr().max_sge).clamp(1, cfg.sges as u32);
    let rc = hca.create_qp(pd, &rc_init(cq, srq, cfg.sq, max_sge))?;
    let a2 = hca.accounting().total();
    for q in [rc, ud] {
        let _ = hca.destroy_qp(q);
    }
    let _ = hca.destroy_srq(srq);
    let _ = hca.destroy_cq(cq);
    let _ = hca.dealloc_pd(pd);
    let slot = (FRAME_HDR + MAX_HDR + cfg.buf) as u64;
    Ok(Footprint {
        per_peer: a2 - a1,
        hca_shared: a1 - a0,
        buffers: (cfg.srq + cfg.send_bufs) as u64 * slot
            + ((UD_RECVS + UD_SENDS) * UD_SLOT + 8) as u64,
        eager_per_peer: cfg.eager_bytes() as u64,
        eager: match cfg.design {
            Design::Fastpath => {
                "fastpath: once a peer has sent WEFT_VERBS_RC_FP_THRESHOLD messages"
            }
            Design::Basic => "basic: every connected peer",
            Design::Piggyback => "piggyback: every connected peer",
            Design::Pipeline => "pipeline: every connected peer",
        },
    })
}

/// The connection manager's UD queue pair.
pub(super) fn ud_init(cq: verbs::Cq) -> verbs::QpInitAttr {
    verbs::QpInitAttr {
        qp_type: QpType::Ud,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: verbs::QpCap {
            max_send_wr: UD_SENDS as u32,
            max_recv_wr: UD_RECVS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: true,
    }
}

/// An RC queue pair towards one peer: receives from the shared receive queue.
pub(super) fn rc_init(cq: verbs::Cq, srq: verbs::Srq, sq: u32, max_sge: u32) -> verbs::QpInitAttr {
    verbs::QpInitAttr {
        qp_type: QpType::Rc,
        send_cq: cq,
        recv_cq: cq,
        srq: Some(srq),
        cap: verbs::QpCap {
            max_send_wr: sq,
            max_recv_wr: 0,
            max_send_sge: max_sge,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: true,
    }
}
