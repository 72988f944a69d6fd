//! Memory as the contract sees it: raw iovecs that outlive a call, registrations with their
//! local descriptor and remote key, and access rights.

/// A local descriptor of registered memory (libfabric's `fi_mr_desc`, a verbs `lkey`): the
/// [`MemRegion::desc`] of a registration that covers an iovec entry. Meaningful only to
/// providers that ask for descriptors ([`super::Caps::mr_local`]); 0 otherwise.
pub type MrDesc = u64;

/// A raw read-only iovec entry, for operations that outlive the call. `desc` is the local
/// descriptor of the registration covering it when the provider asked for descriptors
/// ([`super::Caps::mr_local`]), else 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawIov {
    pub ptr: *const u8,
    pub len: usize,
    pub desc: MrDesc,
}

impl RawIov {
    /// An entry without a descriptor.
    #[inline]
    pub const fn new(ptr: *const u8, len: usize) -> Self {
        RawIov { ptr, len, desc: 0 }
    }
}

/// A raw writable iovec entry, for operations that outlive the call; `desc` as in [`RawIov`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawIovMut {
    pub ptr: *mut u8,
    pub len: usize,
    pub desc: MrDesc,
}

impl RawIovMut {
    /// An entry without a descriptor.
    #[inline]
    pub const fn new(ptr: *mut u8, len: usize) -> Self {
        RawIovMut { ptr, len, desc: 0 }
    }
}

/// One native atomic operation: the `count` elements of `ty` at the target become
/// `target op origin` — or, for `Op::Cswap`, `origin` where they equal `compare` — and their
/// old values go to `result` when it is not null. `desc` holds the local descriptors of
/// origin, compare and result for providers that need them ([`super::Caps::mr_local`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicOp {
    pub op: crate::types::Op,
    pub ty: crate::types::BasicType,
    pub count: usize,
    pub origin: *const u8,
    pub compare: *const u8,
    pub result: *mut u8,
    pub desc: [MrDesc; 3],
}

/// Where a remote RMA access lands: a key and an address as the target registered them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteAddr {
    pub addr: u64,
    pub key: u64,
}

/// A registered memory region (`fi_mr_reg`, `ibv_reg_mr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemRegion {
    /// Remote key: what a peer presents to access the region (`rkey`).
    pub key: u64,
    /// Address a peer uses for the region's first byte.
    pub addr: u64,
    pub len: usize,
    /// Provider-private handle.
    pub handle: u64,
    /// Local descriptor (`lkey`) to put in [`RawIov::desc`] of memory inside the region.
    pub desc: MrDesc,
}

/// Access rights of a registration (verbs' `IBV_ACCESS_*`, libfabric's `FI_READ | FI_REMOTE_*`).
/// Reading local memory through a registration is always allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    /// The provider may write into the region locally (a receive or an RMA read lands there).
    pub local_write: bool,
    pub remote_read: bool,
    pub remote_write: bool,
    pub remote_atomic: bool,
    /// A hint, not a right: other pending receives may place data in this region at the same
    /// time (a receive into a `SharedBuf`, OSU's window of receives into one buffer). A
    /// provider must then put every byte there straight from the wire and never copy within
    /// the region (e.g. move a piece that landed in another piece's place): what it reads
    /// back may already be another receive's. Not carried by the C ABI (1.1).
    pub shared: bool,
}

impl Access {
    /// Local reads only (a send buffer, the origin of a write).
    pub const LOCAL: Access = Access {
        local_write: false,
        remote_read: false,
        remote_write: false,
        remote_atomic: false,
        shared: false,
    };
    /// Local writes (a receive buffer, the destination of a read or of fetched values).
    pub const LOCAL_WRITE: Access = Access {
        local_write: true,
        ..Access::LOCAL
    };
    pub const READ: Access = Access {
        remote_read: true,
        ..Access::LOCAL
    };
    pub const WRITE: Access = Access {
        remote_write: true,
        ..Access::LOCAL
    };
    pub const ALL: Access = Access {
        local_write: true,
        remote_read: true,
        remote_write: true,
        remote_atomic: true,
        shared: false,
    };

    /// Every right of `o` is granted here too (the `shared` hint is not a right).
    #[inline]
    pub const fn contains(self, o: Access) -> bool {
        (self.local_write || !o.local_write)
            && (self.remote_read || !o.remote_read)
            && (self.remote_write || !o.remote_write)
            && (self.remote_atomic || !o.remote_atomic)
    }

    /// The rights of both.
    #[inline]
    pub const fn union(self, o: Access) -> Access {
        Access {
            local_write: self.local_write || o.local_write,
            remote_read: self.remote_read || o.remote_read,
            remote_write: self.remote_write || o.remote_write,
            remote_atomic: self.remote_atomic || o.remote_atomic,
            shared: self.shared || o.shared,
        }
    }

    /// Any remote right.
    #[inline]
    pub const fn is_remote(self) -> bool {
        self.remote_read || self.remote_write || self.remote_atomic
    }
}
