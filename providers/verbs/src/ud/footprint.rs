//! The queues and pools verbs-ud opens with, and what one process and one peer cost
//! (`footprint()`, for `weft info`), measured on a soft HCA of its own.

use super::*;

/// The completion queue, the UD QP every peer reaches and the zero-copy pool's QPs, activated
/// with `qkey` when given.
pub(super) fn create_queues(
    hca: &dyn Hca,
    pd: verbs::Pd,
    cfg: &Config,
    qkey: Option<u32>,
) -> Result<(verbs::Cq, verbs::Qp, Vec<verbs::Qp>)> {
    let cqe = cfg.recvs as u32 + SQ + 16 + cfg.zcopy_qps as u32 * ZDEPTH;
    let cq = hca.create_cq(cqe.min(hca.attr().max_cqe.max(64)))?;
    let qp = hca.create_qp(pd, &qp_init(cq, cfg.recvs as u32))?;
    if let Some(k) = qkey {
        verbs::activate_ud(hca, qp, k)?;
    }
    let mut zqps = Vec::with_capacity(cfg.zcopy_qps);
    for _ in 0..cfg.zcopy_qps {
        let mut init = qp_init(cq, ZDEPTH);
        init.cap.max_send_wr = 1;
        init.cap.max_recv_sge = 2;
        let q = hca.create_qp(pd, &init)?;
        if let Some(k) = qkey {
            verbs::activate_ud(hca, q, k)?;
        }
        zqps.push(q);
    }
    Ok((cq, qp, zqps))
}

/// The buffer pools: scratch (zero-copy GRHs), receive (where every packet lands: HCA memory
/// where there is enough of it), send, control.
pub(super) fn create_pools(hca: &dyn Hca, pd: verbs::Pd, cfg: &Config) -> Result<[Pool; 4]> {
    Ok([
        Pool::new(hca, pd, 1, 64, false)?,
        Pool::new(hca, pd, cfg.recvs, GRH + cfg.mtu, true)?,
        Pool::new(hca, pd, cfg.send_bufs, cfg.mtu, false)?,
        Pool::new(hca, pd, CTL, PKT, false)?,
    ])
}

/// What verbs-ud costs in memory with the current parameters, from the HCA's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Per process, whatever the number of peers: the completion queue, the UD QP and the
    /// zero-copy pool's QPs (HCA side) ...
    pub hca: u64,
    /// ... and the receive, send and control buffers.
    pub buffers: u64,
    /// Per rank of the job: its entry in the address book and its slot in the peer table
    /// (provider side) ...
    pub per_rank: u64,
    /// ... and per peer talked to, its record (the reliability link among it) and list entries.
    pub per_peer: u64,
}

/// Whether UD-ZCOPY is on under the environment (`WEFT_VERBS_UD_ZCOPY_QPS` above 0): without
/// it, large messages go by the core's pipeline over UD-SR.
pub fn zero_copy_on() -> Result<bool> {
    Ok(Config::from_env()?.zcopy_qps > 0)
}

/// Measure [`Footprint`] on the device `WEFT_VERBS_DEVICE` names.
pub fn footprint() -> Result<Footprint> {
    let mut cfg = Config::from_env()?;
    let hca = verbs::open_default()?;
    cfg.fit_mtu(hca.attr().active_mtu.bytes())?;
    let pd = hca.alloc_pd()?;
    let a0 = hca.accounting();
    let (cq, qp, zqps) = create_queues(&*hca, pd, &cfg, None)?;
    let a1 = hca.accounting();
    let pools = create_pools(&*hca, pd, &cfg)?;
    let a2 = hca.accounting();
    let host: usize = pools.iter().map(Pool::host_bytes).sum();
    for p in &pools {
        p.release(&*hca);
    }
    for q in zqps.into_iter().chain([qp]) {
        let _ = hca.destroy_qp(q);
    }
    let _ = hca.destroy_cq(cq);
    let _ = hca.dealloc_pd(pd);
    Ok(Footprint {
        hca: a1.queues() - a0.queues(),
        buffers: a2.dm_bytes - a1.dm_bytes + host as u64,
        per_rank: (4 + AddressBook::<Endpoint, verbs::Ah>::PER_RANK) as u64,
        per_peer: (std::mem::size_of::<Peer>()
            + 4
            + std::mem::size_of::<Rank>()
            + AddressBook::<Endpoint, verbs::Ah>::PER_ENTRY) as u64,
    })
}

/// The UD queue pair: receives from the shared pool.
pub(super) fn qp_init(cq: verbs::Cq, recvs: u32) -> verbs::QpInitAttr {
    verbs::QpInitAttr {
        qp_type: QpType::Ud,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: verbs::QpCap {
            max_send_wr: SQ,
            max_recv_wr: recvs,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: true,
    }
}
