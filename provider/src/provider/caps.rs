//! Capabilities: what a provider does natively, and its limits, for all peers ([`Caps`]) and
//! per peer where its channels differ ([`PeerCaps`]).

use crate::types::AtomicTable;
use crate::{Error, ErrorDetail, Result};

/// When a provider reports a write or an atomic complete ([`super::Completion`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompletionLevel {
    /// **Delivery complete**: the data is in the target's memory, visible to the target's CPU
    /// and to any later operation on it (libfabric `FI_DELIVERY_COMPLETE`; an RC write whose
    /// acknowledgement came back).
    #[default]
    Delivery,
    /// **Transmit complete**: the local buffer may be reused, but the data may still be on its
    /// way (libfabric `FI_TRANSMIT_COMPLETE`). The core then proves delivery itself before a
    /// synchronisation ends: with a fenced read to the target ([`RmaCaps::fence`]), or by
    /// not using native writes at all.
    Transmit,
}

/// RMA capabilities of a provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RmaCaps {
    /// One-sided read of a peer's registered memory (always delivery complete at the origin:
    /// the data has arrived).
    pub read: bool,
    /// One-sided write into a peer's registered memory.
    pub write: bool,
    /// Longest local iovec one RMA operation takes.
    pub max_iov: usize,
    /// Remote keys can be computed locally from a window id (libfabric's scalable registration):
    /// windows then keep no per-peer key table.
    pub scalable_keys: bool,
    /// The provider can place window memory itself (e.g. in a shared segment).
    pub alloc: bool,
    /// Passive-target locks on provider-placed window memory without the target's help
    /// (`rma_try_lock` / `rma_unlock`, e.g. a lock word in shared memory).
    pub native_locks: bool,
    /// Any user memory can be registered (windows over user buffers, zero-copy rendezvous);
    /// `false`: only memory the provider places itself (`mem_alloc`) is reachable natively.
    pub user_memory: bool,
    /// What completion of a write or an atomic means.
    pub completion: CompletionLevel,
    /// [`super::Completion::fence`] is honoured.
    pub fence: bool,
    /// Bytes of remote completion data `rma_write_data` delivers to the target (0: none; 4 on
    /// InfiniBand, `IBV_WR_RDMA_WRITE_WITH_IMM`; up to 8, libfabric's `cq_data_size`).
    pub cq_data_size: usize,
    /// Registrations for remote access serve the **write rendezvous only**: a receive buffer
    /// registered for one peer's single write of the whole message (at the region's `addr`,
    /// from offset 0), not windows. A datagram fabric can place such a write without a copy
    /// (verbs-ud's UD zero-copy posts the buffer as receives) but cannot reach arbitrary
    /// memory at any time, so windows go by active messages. `weft info`: `rma-rndv-only`.
    pub rndv_only: bool,
}

impl RmaCaps {
    /// Writes and atomics complete at the target when they complete here.
    pub fn delivery_complete(&self) -> bool {
        self.completion == CompletionLevel::Delivery
    }
}

/// Active-message header bytes every provider must carry ([`Caps::max_am_header`] at least
/// this): the core's protocol headers are at most this long.
pub const MIN_AM_HEADER: usize = 64;

/// What a provider can do, and its limits. Capabilities are honest: a provider that says it
/// does something natively does it natively.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caps {
    /// Largest active-message header in bytes.
    pub max_am_header: usize,
    /// Largest active-message payload in bytes, to any peer (the rendezvous chunk size; a peer's
    /// [`PeerCaps::max_am_payload`] may be smaller).
    pub max_am_payload: usize,
    /// Messages up to this size go eagerly (`<= max_am_payload`); `WEFT_EAGER_LIMIT` overrides.
    pub eager_limit: usize,
    /// Longest payload iovec `am_send` takes.
    pub max_iov: usize,
    /// The provider matches tagged messages itself (libfabric FI_TAGGED).
    pub tagged: bool,
    /// Memory registration and RMA, if any.
    pub rma: Option<RmaCaps>,
    /// Native (operation, type) atomic pairs.
    pub atomics: AtomicTable,
    /// Elements one native atomic call may cover (0: any number; 1 on an HCA, whose atomics
    /// are single 8-byte compare-and-swap and fetch-and-add). The core splits longer ones.
    pub atomic_max_count: usize,
    /// Completion counters ([`super::Provider::cntr_open`]) for RMA and atomic operations.
    pub counters: bool,
    /// Ranks may live in different processes. When false (ranks are threads of one process,
    /// which may copy into each other's windows under the provider's own lock), the core does
    /// its local window accesses of native windows as RMA to itself, and the provider must
    /// finish such self-directed reads and writes within the call (writes at least copied
    /// out; a transmit-complete write is then proven landed by a fenced read).
    pub spans_processes: bool,
    /// Ranks may live on different hosts.
    pub spans_hosts: bool,
    /// The provider needs a local descriptor ([`super::RawIov::desc`]) on every iovec entry of
    /// tagged, RMA, atomic and `am_isend` calls (libfabric `FI_MR_LOCAL`): the core registers
    /// those buffers (through its registration cache) and fills the descriptors.
    pub mr_local: bool,
    /// Registrations pin physical pages (an HCA without on-demand paging): a registration kept
    /// after its memory was unmapped and mapped again at the same address would reach the old
    /// pages. The core's registration cache then checks page frames before reusing one (or does
    /// not cache). `false`: registrations follow the page tables (CMA, a soft HCA, ODP).
    pub mr_pins: bool,
    /// Zero-copy active messages ([`super::Provider::am_isend`]).
    pub am_isend: bool,
    /// Payloads up to this many bytes cost nothing extra to copy: the core sends them with
    /// `am_send` even when `am_isend` exists (libfabric's inject size).
    pub inject_size: usize,
    /// Connections are made per peer on first use ([`super::Provider::connect`]), not at open.
    pub lazy_connect: bool,
    /// Some peers have narrower capabilities ([`super::Provider::peer_caps`]).
    pub per_peer: bool,
}

impl Caps {
    /// The limits every provider must meet, checked once when a provider is opened under the
    /// core: headers of [`MIN_AM_HEADER`] bytes or more, a payload and an iovec of at least
    /// one (`name` names the provider in the error).
    pub fn check_contract(&self, name: &str) -> Result<()> {
        if self.max_am_header < MIN_AM_HEADER {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "provider '{name}' offers {}-byte active-message headers; weft needs {MIN_AM_HEADER}",
                self.max_am_header
            ))));
        }
        if self.max_am_payload == 0 || self.max_iov == 0 {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "provider '{name}' declares no active-message payload"
            ))));
        }
        Ok(())
    }

    /// Active messages only, with the given limits.
    pub fn am_only(max_am_header: usize, max_am_payload: usize, max_iov: usize) -> Self {
        Caps {
            max_am_header,
            max_am_payload,
            eager_limit: max_am_payload,
            max_iov,
            tagged: false,
            rma: None,
            atomics: AtomicTable::NONE,
            atomic_max_count: 0,
            counters: false,
            spans_processes: true,
            spans_hosts: false,
            mr_local: false,
            mr_pins: false,
            am_isend: false,
            inject_size: 0,
            lazy_connect: false,
            per_peer: false,
        }
    }

    /// The capabilities towards one peer: these, narrowed by `peer` where it says so.
    pub fn towards(&self, peer: Option<&PeerCaps>) -> PeerCaps {
        let mine = PeerCaps::from(self);
        match peer {
            None => mine,
            Some(p) => PeerCaps {
                max_am_payload: p.max_am_payload.min(mine.max_am_payload),
                eager_limit: p.eager_limit.min(mine.eager_limit),
                rma_read: p.rma_read && mine.rma_read,
                rma_write: p.rma_write && mine.rma_write,
                am_isend: p.am_isend && mine.am_isend,
            },
        }
    }

    /// Short list of capability names for `weft info`.
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = vec!["am"];
        if self.am_isend {
            v.push("am-zcopy");
        }
        if self.tagged {
            v.push("tagged");
        }
        if let Some(r) = &self.rma {
            if r.read {
                v.push("rma-read");
            }
            if r.write {
                v.push("rma-write");
            }
            if r.cq_data_size > 0 {
                v.push("rma-cq-data");
            }
            if r.alloc {
                v.push("win-alloc");
            }
            if r.scalable_keys {
                v.push("scalable-keys");
            }
            if r.rndv_only {
                v.push("rma-rndv-only");
            }
        }
        if !self.atomics.is_empty() {
            v.push("atomics");
        }
        if self.counters {
            v.push("counters");
        }
        if self.mr_local {
            v.push("mr-local");
        }
        if self.mr_pins {
            v.push("mr-pins");
        }
        if self
            .rma
            .is_some_and(|r| r.completion == CompletionLevel::Transmit)
        {
            v.push("rma-transmit-complete");
        }
        if self.lazy_connect {
            v.push("lazy-connect");
        }
        if self.per_peer {
            v.push("per-peer-caps");
        }
        v
    }
}

/// What a provider offers towards one peer, where that differs from its [`Caps`] (a hybrid's
/// datagram channel before its connection is up; a composition of a host and a network
/// provider). Each field can only narrow the provider-wide value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCaps {
    /// Largest active-message payload to this peer.
    pub max_am_payload: usize,
    /// Eager limit towards this peer.
    pub eager_limit: usize,
    /// RMA reads of this peer's memory (the zero-copy rendezvous).
    pub rma_read: bool,
    /// RMA writes into this peer's memory.
    pub rma_write: bool,
    /// `am_isend` to this peer.
    pub am_isend: bool,
}

impl From<&Caps> for PeerCaps {
    fn from(c: &Caps) -> Self {
        PeerCaps {
            max_am_payload: c.max_am_payload,
            eager_limit: c.eager_limit,
            rma_read: c.rma.is_some_and(|r| r.read),
            rma_write: c.rma.is_some_and(|r| r.write),
            am_isend: c.am_isend,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The contract's limits refuse a provider by name and reason.
    #[test]
    fn the_contract_refuses_short_headers_and_no_payload() {
        assert!(Caps::am_only(MIN_AM_HEADER, 1024, 1)
            .check_contract("ok")
            .is_ok());
        let e = Caps::am_only(MIN_AM_HEADER - 1, 1024, 1)
            .check_contract("short")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'short'") && e.contains("63-byte") && e.contains("64"),
            "{e}"
        );
        for c in [Caps::am_only(64, 0, 1), Caps::am_only(64, 1024, 0)] {
            let e = c.check_contract("empty").unwrap_err().to_string();
            assert!(
                e.contains("'empty' declares no active-message payload"),
                "{e}"
            );
        }
    }
}
