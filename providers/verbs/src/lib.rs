//! weft's InfiniBand layer: an interface shaped like ibverbs ([`Hca`]) with two backends —
//! the **soft HCA** ([`soft::SoftHca`]), a faithful user-space emulation for machines without
//! InfiniBand, and real HCAs through rdma-core (`rdma::RdmaHca`, with the `rdma-core` cargo
//! feature; see `docs/verbs.md`).
//!
//! On it, the two channels: [`rc`] (Reliable Connection: on-demand connections, send/receive
//! over a shared receive queue, eager rings, native RDMA and atomics) and [`ud`] (Unreliable
//! Datagram: one QP for every peer, reliability by `weft_proto::reliable`, UD zero-copy). Each
//! implements the provider contract — the `verbs-rc` and `verbs-ud` crates register them under
//! those names — and [`channel`] declares what a composition (the `hybrid` provider) asks of
//! them beyond it. All are written against [`Hca`] only, so what passes on the soft HCA runs
//! the same on hardware. `WEFT_VERBS_DEVICE` picks the device.
//!
//! ```no_run
//! use weft_verbs::*;
//! let hca = open_device("soft").unwrap();
//! let pd = hca.alloc_pd().unwrap();
//! let cq = hca.create_cq(64).unwrap();
//! let qp = hca
//!     .create_qp(pd, &QpInitAttr {
//!         qp_type: QpType::Rc,
//!         send_cq: cq,
//!         recv_cq: cq,
//!         srq: None,
//!         cap: QpCap::default(),
//!         sq_sig_all: false,
//!     })
//!     .unwrap();
//! // exchange Endpoint::of(&*hca, qp).to_string() with the peer, then connect_rc(...)
//! ```

pub mod channel;
pub mod hca;
pub mod pool;
pub mod rc;
#[cfg(feature = "rdma-core")]
pub mod rdma;
pub mod soft;
use weft_proto::sync;
pub mod types;
pub mod ud;

pub use hca::{Accounting, Counters, Hca};
pub use pool::{Chunked, Pool};
pub use types::*;

use std::sync::Arc;
use weft_provider::{Error, ErrorDetail, Result};

/// A device the machine offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub name: String,
    /// `soft`, or `rdma-core`.
    pub backend: &'static str,
    /// Whether this build can open it.
    pub usable: bool,
    pub note: String,
}

/// The RDMA devices the kernel exposes (`/sys/class/infiniband`).
pub fn hardware_devices() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Every device: the real HCAs first, then the soft HCA (always there).
pub fn devices() -> Vec<DeviceInfo> {
    #[cfg(feature = "rdma-core")]
    let libibverbs = rdma::device_names();
    #[cfg(not(feature = "rdma-core"))]
    let libibverbs: Vec<String> = Vec::new();
    let mut names = hardware_devices();
    names.extend(libibverbs.iter().cloned());
    names.sort();
    names.dedup();
    let mut v: Vec<DeviceInfo> = names
        .into_iter()
        .map(|name| {
            let usable = libibverbs.contains(&name);
            let note = if usable {
                "through rdma-core".to_string()
            } else if cfg!(feature = "rdma-core") {
                "the kernel lists it but libibverbs has no driver for it".to_string()
            } else {
                "this build has no rdma-core backend (cargo feature weft-verbs/rdma-core)"
                    .to_string()
            };
            DeviceInfo {
                name,
                backend: "rdma-core",
                usable,
                note,
            }
        })
        .collect();
    v.push(DeviceInfo {
        name: "soft".into(),
        backend: "soft",
        usable: true,
        note: "user-space HCA: shared memory on this host, UDP to others".into(),
    });
    v
}

/// Why there is no real HCA to use, for an unavailable-provider reason; `None` when there is.
pub fn no_hardware_reason() -> Option<String> {
    let d = devices();
    if d.iter().any(|x| x.usable && x.backend == "rdma-core") {
        return None;
    }
    Some(match d.iter().find(|x| x.backend == "rdma-core") {
        Some(x) => format!("no usable RDMA device ({}: {})", x.name, x.note),
        None => "no RDMA device".into(),
    })
}

/// Open `name`: `soft`, a hardware device name, or `auto` (the first usable real HCA, else
/// the soft HCA). An unknown or unusable device is an error saying why.
pub fn open_device(name: &str) -> Result<Arc<dyn Hca>> {
    let devs = devices();
    let pick = match name.trim() {
        "auto" | "" => devs.iter().find(|d| d.usable).cloned(),
        n => devs.iter().find(|d| d.name == n).cloned(),
    };
    match pick {
        Some(d) if d.backend == "soft" => Ok(soft::SoftHca::open_shared()?),
        #[cfg(feature = "rdma-core")]
        Some(d) if d.usable => Ok(Arc::new(rdma::RdmaHca::open(&d.name)?)),
        Some(d) => Err(Error::from(ErrorDetail::Unsupported(format!(
            "RDMA device {}: {}",
            d.name, d.note
        )))),
        None => Err(Error::from(ErrorDetail::Unsupported(format!(
            "no RDMA device '{name}'; devices: {}",
            devs.iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )))),
    }
}

/// Open the device `WEFT_VERBS_DEVICE` names.
pub fn open_default() -> Result<Arc<dyn Hca>> {
    open_device(&soft::model::DEVICE.get_str())
}

/// What one side of an RC connection tells the other over the bootstrap: its GID, QP number,
/// first PSN and, on an InfiniBand fabric, its port's LID (`<gid hex>:<qpn hex>:<psn hex>`,
/// then `:<lid hex>` when the LID is not 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub gid: Gid,
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
}

impl Endpoint {
    pub fn of(hca: &dyn Hca, qp: Qp, psn: u32) -> Endpoint {
        Endpoint {
            gid: hca.gid(),
            qpn: qp.qpn,
            psn: psn & 0xff_ffff,
            lid: hca.lid(),
        }
    }

    /// The address vector that reaches this endpoint's port (port 1): for an address handle,
    /// or an RC QP's path.
    pub fn ah_attr(&self) -> AhAttr {
        AhAttr {
            dgid: self.gid,
            dlid: self.lid,
            port_num: 1,
        }
    }

    /// Whether a UD receive the HCA stamped with the sender's QP number `src_qp` and (when
    /// the receive has one) global route header `grh` came from this endpoint's QP on this
    /// endpoint's HCA: no sender chooses those. A GRH as InfiniBand and RoCE v1 lay it out
    /// carries the source GID at bytes 8..24; RoCE v2 over IPv4 puts an IPv4 header in its
    /// last 20 bytes, whose source address is the GID's IPv4-mapped part.
    pub fn sent(&self, src_qp: u32, grh: Option<&[u8]>) -> bool {
        if self.qpn != src_qp {
            return false;
        }
        match grh {
            Some(g) if g.len() >= GRH_LEN && g[0] >> 4 == 6 => g[8..24] == self.gid.0,
            Some(g) if g.len() >= GRH_LEN && g[20] >> 4 == 4 => g[32..36] == self.gid.0[12..16],
            _ => true,
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.gid.0 {
            write!(f, "{b:02x}")?;
        }
        write!(f, ":{:x}:{:x}", self.qpn, self.psn)?;
        if self.lid != 0 {
            write!(f, ":{:x}", self.lid)?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Endpoint {
    type Err = Error;
    fn from_str(s: &str) -> Result<Endpoint> {
        let bad = |why: &str| Error::invalid(format!("verbs endpoint '{s}': {why}"));
        let mut it = s.split(':');
        let (g, q, p, l) = match (it.next(), it.next(), it.next(), it.next(), it.next()) {
            (Some(g), Some(q), Some(p), l, None) => (g, q, p, l),
            _ => return Err(bad("expected GID:QPN:PSN[:LID]")),
        };
        if g.len() != 32 || !g.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad("the GID is 32 hex digits"));
        }
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = u8::from_str_radix(&g[2 * i..2 * i + 2], 16).map_err(|_| bad("GID"))?;
        }
        let num = |x: &str, what: &str| {
            u32::from_str_radix(x, 16)
                .ok()
                .filter(|v| *v <= 0xff_ffff && !x.is_empty() && x.len() <= 6)
                .ok_or_else(|| bad(&format!("the {what} is a 24-bit hex number")))
        };
        let lid = match l {
            None => 0,
            Some(x) => u16::from_str_radix(x, 16)
                .ok()
                .filter(|v| *v != 0 && !x.is_empty() && x.len() <= 4)
                .ok_or_else(|| bad("the LID is a non-zero 16-bit hex number"))?,
        };
        Ok(Endpoint {
            gid: Gid(gid),
            qpn: num(q, "QPN")?,
            psn: num(p, "PSN")?,
            lid,
        })
    }
}

/// The attributes RC connection set-up uses (MVAPICH2's defaults: timeout 20, 7 retries,
/// 7 RNR retries, RNR timer 12 = 0.64 ms).
#[derive(Debug, Clone, Copy)]
pub struct RcParams {
    pub access: Access,
    pub mtu: Mtu,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub rd_atomic: u8,
}

impl Default for RcParams {
    fn default() -> RcParams {
        RcParams {
            access: Access::ALL,
            mtu: Mtu::M2048,
            timeout: 20,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            rd_atomic: 4,
        }
    }
}

/// Take RC QP `qp` from RESET to RTS towards `remote` (whose side does the same towards ours),
/// sending from `my_psn`.
pub fn connect_rc(
    hca: &dyn Hca,
    qp: Qp,
    my_psn: u32,
    remote: &Endpoint,
    p: &RcParams,
) -> Result<()> {
    let mtu = if p.mtu.bytes() > hca.attr().active_mtu.bytes() {
        hca.attr().active_mtu
    } else {
        p.mtu
    };
    hca.modify_qp(
        qp,
        &QpAttr {
            qp_state: Some(QpState::Init),
            qp_access_flags: Some(p.access),
            pkey_index: Some(0),
            port_num: Some(1),
            ..QpAttr::default()
        },
    )?;
    hca.modify_qp(
        qp,
        &QpAttr {
            qp_state: Some(QpState::Rtr),
            path_mtu: Some(mtu),
            ah_attr: Some(remote.ah_attr()),
            dest_qp_num: Some(remote.qpn),
            rq_psn: Some(remote.psn),
            max_dest_rd_atomic: Some(p.rd_atomic),
            min_rnr_timer: Some(p.min_rnr_timer),
            ..QpAttr::default()
        },
    )?;
    hca.modify_qp(
        qp,
        &QpAttr {
            qp_state: Some(QpState::Rts),
            sq_psn: Some(my_psn),
            timeout: Some(p.timeout),
            retry_cnt: Some(p.retry_cnt),
            rnr_retry: Some(p.rnr_retry),
            max_rd_atomic: Some(p.rd_atomic),
            ..QpAttr::default()
        },
    )
}

/// Take UD QP `qp` from RESET to RTS with `qkey`.
pub fn activate_ud(hca: &dyn Hca, qp: Qp, qkey: u32) -> Result<()> {
    hca.modify_qp(
        qp,
        &QpAttr {
            qp_state: Some(QpState::Init),
            qkey: Some(qkey),
            pkey_index: Some(0),
            port_num: Some(1),
            ..QpAttr::default()
        },
    )?;
    hca.modify_qp(
        qp,
        &QpAttr {
            qp_state: Some(QpState::Rtr),
            ..QpAttr::default()
        },
    )?;
    hca.modify_qp(
        qp,
        &QpAttr {
            qp_state: Some(QpState::Rts),
            sq_psn: Some(0),
            ..QpAttr::default()
        },
    )
}

/// Poll `cq` until `n` completions arrived or `timeout` passed (an error naming what is
/// missing: no test or benchmark waits without bound).
pub fn wait_cq(hca: &dyn Hca, cq: Cq, n: usize, timeout: std::time::Duration) -> Result<Vec<Wc>> {
    let t0 = std::time::Instant::now();
    let mut got = Vec::with_capacity(n);
    let mut buf = [Wc::EMPTY; 16];
    while got.len() < n {
        let k = hca.poll_cq(cq, &mut buf[..(n - got.len()).min(16)])?;
        got.extend_from_slice(&buf[..k]);
        if k == 0 {
            if t0.elapsed() > timeout {
                return Err(Error::from(ErrorDetail::Timeout {
                    what: format!("{} of {n} completions on CQ {}", n - got.len(), cq.0),
                    secs: timeout.as_secs_f64(),
                }));
            }
            std::hint::spin_loop();
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn endpoints_round_trip_and_reject_junk() {
        let e = Endpoint {
            gid: Gid([7; 16]),
            qpn: 0x1_0002,
            psn: 0xabcdef,
            lid: 0,
        };
        assert_eq!(e.to_string().parse::<Endpoint>().unwrap(), e);
        assert_eq!(e.to_string().matches(':').count(), 2, "no LID, no field");
        let l = Endpoint { lid: 0x1f, ..e };
        assert!(l.to_string().ends_with(":abcdef:1f"));
        assert_eq!(l.to_string().parse::<Endpoint>().unwrap(), l);
        for bad in [
            "",
            "x",
            "07:1:2",
            &format!("{}:1", "0".repeat(32)),
            &format!("{}:1:1000000", "0".repeat(32)),
            &format!("{}:1:2:0", "0".repeat(32)),
            &format!("{}:1:2:10000", "0".repeat(32)),
            &format!("{}:1:2:3:4", "0".repeat(32)),
        ] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        #[cfg_attr(miri, ignore)]
        fn endpoint_parser_never_panics(s in ".{0,80}") {
            let _ = s.parse::<Endpoint>();
        }

        #[test]
        #[cfg_attr(miri, ignore)]
        fn endpoint_round_trips(g in any::<[u8; 16]>(), q in 0u32..1 << 24, p in 0u32..1 << 24,
                                lid in any::<u16>()) {
            let e = Endpoint { gid: Gid(g), qpn: q, psn: p, lid };
            prop_assert_eq!(e.to_string().parse::<Endpoint>().unwrap(), e);
        }
    }

    #[test]
    fn the_soft_device_is_always_listed() {
        let d = devices();
        assert_eq!(d.last().map(|d| d.name.as_str()), Some("soft"));
        assert!(open_device("mlx_nope").is_err());
        // Without hardware (this machine, CI) the reason says so, and `auto` is the soft HCA.
        if d.iter().all(|x| x.backend == "soft") {
            assert_eq!(no_hardware_reason().as_deref(), Some("no RDMA device"));
            assert_eq!(open_device("auto").unwrap().attr().kind, "soft");
        }
    }
}
