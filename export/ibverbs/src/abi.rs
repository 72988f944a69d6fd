//! The structures of rdma-core 44's `infiniband/verbs.h` that programs read or write, written
//! out field by field (the names are the header's, so a reader can check them side by side).
//! `layout_matches_the_installed_header` compiles a C program against Debian's header and
//! compares every size and offset used here.

#![allow(non_camel_case_types)]

use libc::{c_char, c_int, c_uint, c_void, pthread_cond_t, pthread_mutex_t};

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

#[repr(C)]
pub struct ibv_device {
    pub _ops: [usize; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

pub type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotify = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
pub type PostSrqRecv =
    unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type PostSend =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecv =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`: 32 entries; the data path (`poll_cq`, `req_notify_cq`,
/// `post_srq_recv`, `post_send`, `post_recv`) is what the header's inline functions call.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat: [usize; 11],
    pub poll_cq: Option<PollCq>,
    pub req_notify_cq: Option<ReqNotify>,
    pub _compat2: [usize; 7],
    pub post_srq_recv: Option<PostSrqRecv>,
    pub _compat3: [usize; 4],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
    pub _compat4: [usize; 5],
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// `struct verbs_context`: the extended operations (39 words, newest first), then `sz`, then
/// the `ibv_context` programs hold. Every extended entry is left NULL: the header's inline
/// functions then answer `EOPNOTSUPP`/`ENOSYS` themselves, or fall back to the legacy calls
/// (`ibv_query_device`, `ibv_query_port`, `ibv_create_qp`), as with a provider that lacks them.
#[repr(C)]
pub struct verbs_context {
    pub ext: [usize; 39],
    pub sz: usize,
    pub context: ibv_context,
}

/// What `verbs_get_ctx` looks for in `abi_compat` (`__VERBS_ABI_IS_EXTENDED`, `(void *)-1`).
pub const VERBS_ABI_IS_EXTENDED: *mut c_void = usize::MAX as *mut c_void;

#[repr(C)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

#[repr(C)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `union ibv_gid` holds two `__be64`s: 8-aligned, so is everything that holds one.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct ibv_global_route {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_attr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `wr.rdma`, `wr.atomic` and `wr.ud` of `struct ibv_send_wr`, as one union.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: WrRdma,
    pub atomic: WrAtomic,
    pub ud: WrUd,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct WrRdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct WrAtomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct WrUd {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    pub qp_type: u32,
    /// `bind_mw` / `tso` (weft offers neither; 48 bytes).
    pub _tail: [u64; 6],
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

#[repr(C)]
pub struct ibv_async_event {
    pub element: *mut c_void,
    pub event_type: c_int,
}

#[repr(C, align(8))]
pub struct ibv_gid_entry {
    pub gid: [u8; 16],
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct ibv_ah {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

/// The GRH at the head of a UD receive buffer (40 bytes): the sender's GID is at 8..24.
pub const GRH_SGID: std::ops::Range<usize> = 8..24;

// `enum ibv_qp_attr_mask`.
pub const QP_STATE: c_int = 1;
pub const QP_CUR_STATE: c_int = 1 << 1;
pub const QP_EN_SQD_ASYNC_NOTIFY: c_int = 1 << 2;
pub const QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const QP_PKEY_INDEX: c_int = 1 << 4;
pub const QP_PORT: c_int = 1 << 5;
pub const QP_QKEY: c_int = 1 << 6;
pub const QP_AV: c_int = 1 << 7;
pub const QP_PATH_MTU: c_int = 1 << 8;
pub const QP_TIMEOUT: c_int = 1 << 9;
pub const QP_RETRY_CNT: c_int = 1 << 10;
pub const QP_RNR_RETRY: c_int = 1 << 11;
pub const QP_RQ_PSN: c_int = 1 << 12;
pub const QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const QP_ALT_PATH: c_int = 1 << 14;
pub const QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const QP_SQ_PSN: c_int = 1 << 16;
pub const QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const QP_PATH_MIG_STATE: c_int = 1 << 18;
pub const QP_CAP: c_int = 1 << 19;
pub const QP_DEST_QPN: c_int = 1 << 20;

// `enum ibv_send_flags`, `enum ibv_wc_flags`.
pub const SEND_SIGNALED: c_uint = 1 << 1;
pub const SEND_INLINE: c_uint = 1 << 3;
pub const WC_GRH: c_uint = 1;
pub const WC_WITH_IMM: c_uint = 1 << 1;

// `enum ibv_event_type`: the events the soft HCA raises.
pub const EVENT_SRQ_LIMIT_REACHED: c_int = 15;
pub const EVENT_CQ_ERR: c_int = 0;
pub const EVENT_QP_FATAL: c_int = 1;
pub const EVENT_QP_REQ_ERR: c_int = 2;
pub const EVENT_QP_ACCESS_ERR: c_int = 3;
pub const EVENT_QP_LAST_WQE_REACHED: c_int = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// (C expression, the value weft's definition gives it).
    fn ours() -> Vec<(&'static str, usize)> {
        macro_rules! f {
            ($v:ident, $t:ident, $($f:tt)+) => {
                $v.push((concat!("offsetof(struct ", stringify!($t), ", ", stringify!($($f)+), ")"),
                         offset_of!($t, $($f)+)));
            };
        }
        macro_rules! s {
            ($v:ident, $t:ident) => {
                $v.push((
                    concat!("sizeof(struct ", stringify!($t), ")"),
                    size_of::<$t>(),
                ));
            };
        }
        let mut v = Vec::new();
        s!(v, ibv_device);
        f!(v, ibv_device, name);
        f!(v, ibv_device, ibdev_path);
        s!(v, ibv_context_ops);
        f!(v, ibv_context_ops, poll_cq);
        f!(v, ibv_context_ops, req_notify_cq);
        f!(v, ibv_context_ops, post_srq_recv);
        f!(v, ibv_context_ops, post_send);
        f!(v, ibv_context_ops, post_recv);
        s!(v, ibv_context);
        f!(v, ibv_context, async_fd);
        f!(v, ibv_context, mutex);
        f!(v, ibv_context, abi_compat);
        s!(v, verbs_context);
        f!(v, verbs_context, sz);
        f!(v, verbs_context, context);
        s!(v, ibv_device_attr);
        f!(v, ibv_device_attr, max_qp);
        f!(v, ibv_device_attr, atomic_cap);
        f!(v, ibv_device_attr, max_srq_sge);
        f!(v, ibv_device_attr, phys_port_cnt);
        s!(v, ibv_port_attr);
        f!(v, ibv_port_attr, pkey_tbl_len);
        f!(v, ibv_port_attr, link_layer);
        f!(v, ibv_port_attr, port_cap_flags2);
        s!(v, ibv_wc);
        f!(v, ibv_wc, imm_data);
        f!(v, ibv_wc, wc_flags);
        f!(v, ibv_wc, sl);
        s!(v, ibv_ah_attr);
        f!(v, ibv_ah_attr, dlid);
        f!(v, ibv_ah_attr, is_global);
        f!(v, ibv_ah_attr, port_num);
        s!(v, ibv_qp_init_attr);
        f!(v, ibv_qp_init_attr, cap);
        f!(v, ibv_qp_init_attr, qp_type);
        s!(v, ibv_qp_attr);
        f!(v, ibv_qp_attr, cap);
        f!(v, ibv_qp_attr, ah_attr);
        f!(v, ibv_qp_attr, pkey_index);
        f!(v, ibv_qp_attr, max_rd_atomic);
        f!(v, ibv_qp_attr, rnr_retry);
        f!(v, ibv_qp_attr, rate_limit);
        s!(v, ibv_send_wr);
        f!(v, ibv_send_wr, num_sge);
        f!(v, ibv_send_wr, imm_data);
        f!(v, ibv_send_wr, wr);
        f!(v, ibv_send_wr, qp_type);
        v.push((
            "offsetof(struct ibv_send_wr, wr.atomic.rkey)",
            offset_of!(ibv_send_wr, wr) + offset_of!(WrAtomic, rkey),
        ));
        v.push((
            "offsetof(struct ibv_send_wr, wr.ud.remote_qkey)",
            offset_of!(ibv_send_wr, wr) + offset_of!(WrUd, remote_qkey),
        ));
        s!(v, ibv_global_route);
        v.push((
            "_Alignof(struct ibv_qp_attr)",
            std::mem::align_of::<ibv_qp_attr>(),
        ));
        s!(v, ibv_recv_wr);
        s!(v, ibv_sge);
        s!(v, ibv_srq_init_attr);
        s!(v, ibv_async_event);
        f!(v, ibv_async_event, event_type);
        s!(v, ibv_gid_entry);
        s!(v, ibv_comp_channel);
        s!(v, ibv_cq);
        f!(v, ibv_cq, cond);
        f!(v, ibv_cq, async_events_completed);
        s!(v, ibv_srq);
        f!(v, ibv_srq, events_completed);
        s!(v, ibv_qp);
        f!(v, ibv_qp, qp_num);
        f!(v, ibv_qp, events_completed);
        s!(v, ibv_pd);
        s!(v, ibv_mr);
        f!(v, ibv_mr, rkey);
        s!(v, ibv_ah);
        for (e, n) in [
            ("IBV_EVENT_CQ_ERR", EVENT_CQ_ERR),
            ("IBV_EVENT_QP_FATAL", EVENT_QP_FATAL),
            ("IBV_EVENT_QP_REQ_ERR", EVENT_QP_REQ_ERR),
            ("IBV_EVENT_QP_ACCESS_ERR", EVENT_QP_ACCESS_ERR),
            ("IBV_EVENT_SRQ_LIMIT_REACHED", EVENT_SRQ_LIMIT_REACHED),
            ("IBV_EVENT_QP_LAST_WQE_REACHED", EVENT_QP_LAST_WQE_REACHED),
        ] {
            v.push((e, n as usize));
        }
        v
    }

    /// Every size and offset above, against Debian's `infiniband/verbs.h` (libibverbs-dev;
    /// skipped without it, unless `WEFT_REQUIRE_TOOLS=1`).
    #[test]
    fn layout_matches_the_installed_header() {
        let hdr = std::path::Path::new("/usr/include/infiniband/verbs.h");
        if !hdr.exists() {
            assert!(
                std::env::var("WEFT_REQUIRE_TOOLS").as_deref() != Ok("1"),
                "libibverbs-dev is missing (tools/deps.sh installs it)"
            );
            eprintln!("skipped: no {}", hdr.display());
            return;
        }
        let v = ours();
        let dir = std::env::temp_dir().join(format!("weft-ibv-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = String::from(
            "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
        );
        for (e, _) in &v {
            c.push_str(&format!("  printf(\"%zu\\n\", (size_t)({e}));\n"));
        }
        c.push_str("  return 0;\n}\n");
        std::fs::write(dir.join("l.c"), c).unwrap();
        let o = std::process::Command::new("cc")
            .arg("-o")
            .arg(dir.join("l"))
            .arg(dir.join("l.c"))
            .output()
            .expect("cc");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = std::process::Command::new(dir.join("l")).output().unwrap();
        let got: Vec<usize> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        let bad: Vec<String> = v
            .iter()
            .zip(&got)
            .filter(|((_, a), b)| a != *b)
            .map(|((e, a), b)| format!("{e}: weft {a}, header {b}"))
            .collect();
        assert_eq!(got.len(), v.len());
        assert!(bad.is_empty(), "layout differs:\n{}", bad.join("\n"));
    }
}
