//! `ofi`: weft over any libfabric provider (`tcp;ofi_rxm`, `shm`, `verbs;ofi_rxm`, `efa`, `cxi`,
//! `psm3`...), mapped the way MPICH CH4's OFI netmod maps MPI (paper 003):
//!
//! * **Selection**: `WEFT_OFI_PROVIDER` names the libfabric provider (as `FI_PROVIDER` would);
//!   without it, the first `fi_getinfo` answer for `FI_EP_RDM` with
//!   `FI_TAGGED | FI_MSG | FI_RMA | FI_ATOMIC`, then without atomics, without RMA, without tagged
//!   messaging: each missing capability falls back to the core's active-message path.
//! * **Tagged messaging** natively: `fi_tsendmsg`/`fi_trecvmsg` with weft's context, source rank
//!   and tag packed into the 64-bit tag ([`tag`]), `fi_tinject` for small sends, `FI_PEEK` for
//!   probe, `fi_cancel`; a synchronous send carries its operation in remote CQ data and the
//!   receiver acknowledges the match. Above `WEFT_OFI_RNDV` bytes a send is announced (an empty
//!   tagged message with the length and the operation in its CQ data); the matching receive
//!   answers with the bytes it can take and posts a receive for them in the provider's own
//!   context, then the data follows. A truncated large message thus still delivers its prefix
//!   and its length, and no libfabric provider's handling of a truncated large message is
//!   relied on (libfabric 1.17's `tcp;ofi_rxm` drops the connection, `shm` never completes the
//!   send). Receives smaller than `WEFT_OFI_RNDV` are posted into bounce buffers of that size,
//!   so libfabric never truncates at all.
//! * `WEFT_OFI_NATIVE`: tagged messages, RMA and atomics through libfabric (1), or active
//!   messages only with the core doing the rest (0); `auto` is 0 on shm before libfabric 1.19,
//!   whose tag matching and RMA fail across processes. Without native RMA the provider still
//!   offers the core's write rendezvous (`RmaCaps::rndv_only`): a registration posts the
//!   receive buffer as a tagged receive under an exact tag of its own context, the write is a
//!   tagged send there, so large messages move by libfabric's own bulk path.
//! * **Active messages** over `FI_MSG`: a pool of pre-posted receive buffers; a send is injected
//!   when it fits the provider's inject size, else copied into a send buffer. A 12-byte prefix
//!   carries the kind, the header length, the source rank and a per-pair sequence number (the
//!   receiver restores send order where a provider's completion order does not promise it).
//! * **Addresses** through the bootstrap (`fi_getname`, one allgather) into an `FI_AV_TABLE`.
//! * **RMA and atomics** (module `fabric`): `fi_readmsg`/`fi_writemsg` with iovecs up to the
//!   provider's `iov_limit`, atomics through `fi_atomicmsg`/`fi_fetch_atomicmsg`/
//!   `fi_compare_atomicmsg` for every (operation, type) `fi_query_atomic` accepts; scalable
//!   registration (the window id is the key, addresses are offsets) where the provider lets
//!   the user choose keys; a completion counter per window on an endpoint of its own (bulk
//!   completion for fence and flush), CQ entries for request-based operations.
//!
//! libfabric is opened at run time (`weft-ofi-sys`, which needs no libfabric to build): where
//! it is missing or too old the provider is registered all the same and says why it cannot run,
//! in one line; installing it makes the provider available with no rebuild.

pub mod tag;
pub mod wire;

mod fabric;
pub use fabric::Ofi;

/// One line for `weft info`: the libfabric this process opens, or why it has none.
pub fn library() -> String {
    weft_ofi_sys::describe()
}

weft_provider::param!(pub PROVIDER: Str = "ofi", "PROVIDER", "",
    "the libfabric provider to use (as FI_PROVIDER names it: tcp;ofi_rxm, shm, verbs;ofi_rxm, ...); empty: the first that fi_getinfo offers for FI_EP_RDM");
weft_provider::param!(pub DOMAIN: Str = "ofi", "DOMAIN", "",
    "the libfabric domain (fi_info's domain name, e.g. lo or eth0 for tcp); empty: the first offered");
fn check_rndv(v: &str) -> std::result::Result<(), String> {
    weft_provider::param::checks::auto_or(
        v,
        |t| weft_provider::param::parse_size(t).is_some_and(|n| (64..=1 << 20).contains(&n)),
        "a size from 64 to 1M",
    )
}

fn check_native(v: &str) -> std::result::Result<(), String> {
    weft_provider::param::checks::auto_or(
        v,
        |t| weft_provider::param::parse_bool(t).is_some() && !t.is_empty(),
        "a boolean (1/0)",
    )
}

weft_provider::param!(pub RNDV: Str check(check_rndv) = "ofi", "RNDV", "auto",
    "tagged messages above this size (64 to 1M) are announced and their data sent once the receiver asks; smaller receives go through bounce buffers of this size, so libfabric never truncates; auto: 16K, shm's inject size on shm");
weft_provider::param!(pub NATIVE: Str check(check_native) = "ofi", "NATIVE", "auto",
    "1: tagged messages, RMA and atomics through libfabric wherever the provider offers them; 0: libfabric carries active messages only and weft's core does the rest; auto: 1, but 0 on shm before libfabric 1.19 (its tag matching and RMA fail across processes)");
weft_provider::param!(pub AM_BUF: Size[1 << 10, 1 << 20] = "ofi", "AM_BUF", "16K",
    "bytes of each active-message buffer (the largest active-message payload, 1K to 1M)");
weft_provider::param!(pub AM_RX: Uint[8, 4096] = "ofi", "AM_RX", "64",
    "active-message receive buffers kept posted (8 to 4096); as many send buffers");
// Read by weft-ofi-sys when it opens the library (its name is weft_ofi_sys::LIBRARY_VAR).
weft_provider::param!(pub LIB: Str = "ofi", "LIB", "libfabric.so.1",
    "the libfabric library to open at run time: a file name the dynamic loader finds (LD_LIBRARY_PATH, then the system's) or a path; 1.17 or newer");

weft_provider::register_provider!(
    Ofi,
    priority = 5,
    summary = "any libfabric provider (WEFT_OFI_PROVIDER: tcp;ofi_rxm, shm, verbs;ofi_rxm...)"
);
