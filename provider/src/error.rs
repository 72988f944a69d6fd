//! Typed errors. Everything a user or a peer can cause is an [`Error`] value, never a panic.

use crate::types::Status;

/// The coarse class of an [`Error`], for callers that branch on what went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A rank outside the communicator.
    InvalidRank,
    /// A negative or too large tag.
    InvalidTag,
    /// A bad argument (buffer too small for a datatype, mismatched lengths, ...).
    InvalidArgument,
    /// The message was longer than the receive buffer.
    Truncated,
    /// `WEFT_PROVIDER` named a provider that is not built in or loaded.
    UnknownProvider,
    /// The provider exists but cannot run here (no device, no permission, one process only...).
    ProviderUnavailable,
    /// A loaded provider speaks another version of the C ABI.
    AbiMismatch,
    /// A peer sent something that does not parse.
    Malformed,
    /// A peer died or closed its end.
    PeerFailed,
    /// A remote access outside a registered region or with a bad key.
    RemoteAccess,
    /// The provider does not support the operation and there is no fallback.
    Unsupported,
    /// A bounded wait ran out.
    Timeout,
    /// An environment parameter did not parse.
    Param,
    /// The launcher / PMI server misbehaved.
    Bootstrap,
    /// An operating-system call failed.
    Io,
    /// A provider reported a failure of its own (a loaded library's error code and text).
    Provider,
    /// A request was cancelled.
    Cancelled,
}

/// What went wrong, in detail. Reach it through [`Error::detail`].
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorDetail {
    #[error("invalid rank {rank}: the communicator has {size} ranks")]
    InvalidRank { rank: i64, size: u32 },
    #[error("invalid tag {tag}: tags are 0..={max}")]
    InvalidTag { tag: i64, max: i32 },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error(
        "message truncated: {} bytes from rank {} (tag {}) do not fit a {capacity}-byte buffer",
        status.bytes, status.source, status.tag
    )]
    Truncated { status: Status, capacity: usize },
    #[error("unknown provider '{requested}'; available: {available}")]
    UnknownProvider {
        requested: String,
        available: String,
    },
    #[error("no usable provider for WEFT_PROVIDER='{requested}'; {details}")]
    ProviderUnavailable { requested: String, details: String },
    #[error("ABI mismatch in {file}: provider speaks ABI {found}, weft speaks ABI {expected}")]
    AbiMismatch {
        file: String,
        found: String,
        expected: String,
    },
    #[error("malformed message from rank {peer}: {what}")]
    Malformed { peer: u32, what: String },
    #[error("peer failed: rank {rank} ({reason})")]
    PeerFailed { rank: u32, reason: String },
    #[error("remote access error at rank {rank}: {what}")]
    RemoteAccess { rank: u32, what: String },
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("timed out after {secs:.1} s waiting for {what}")]
    Timeout { what: String, secs: f64 },
    #[error("bad value for {var}='{value}': expected {expected}")]
    Param {
        var: String,
        value: String,
        expected: String,
    },
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
    #[error("request cancelled")]
    Cancelled,
    #[error("provider '{provider}': {what}")]
    Provider { provider: String, what: String },
    #[error("provider library {file}: {what}")]
    LoadFailed { file: String, what: String },
}

/// weft's error type: one pointer wide, so `Result<T>` stays small on hot paths.
#[derive(Clone)]
pub struct Error(Box<ErrorDetail>);

impl From<ErrorDetail> for Error {
    fn from(d: ErrorDetail) -> Self {
        Error(Box::new(d))
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.0)
    }
}

impl ErrorDetail {
    fn kind(&self) -> ErrorKind {
        use ErrorDetail as Error;
        match self {
            Error::InvalidRank { .. } => ErrorKind::InvalidRank,
            Error::InvalidTag { .. } => ErrorKind::InvalidTag,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::Truncated { .. } => ErrorKind::Truncated,
            Error::UnknownProvider { .. } => ErrorKind::UnknownProvider,
            Error::ProviderUnavailable { .. } => ErrorKind::ProviderUnavailable,
            Error::AbiMismatch { .. } => ErrorKind::AbiMismatch,
            Error::Malformed { .. } => ErrorKind::Malformed,
            Error::PeerFailed { .. } => ErrorKind::PeerFailed,
            Error::RemoteAccess { .. } => ErrorKind::RemoteAccess,
            Error::Unsupported(_) => ErrorKind::Unsupported,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::Param { .. } => ErrorKind::Param,
            Error::Bootstrap(_) => ErrorKind::Bootstrap,
            Error::Io { .. } => ErrorKind::Io,
            Error::Cancelled => ErrorKind::Cancelled,
            Error::Provider { .. } | Error::LoadFailed { .. } => ErrorKind::Provider,
        }
    }
}

impl Error {
    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        self.0.kind()
    }

    /// The details.
    pub fn detail(&self) -> &ErrorDetail {
        &self.0
    }

    /// For a truncated receive: the status (its `bytes` is the message length) and the
    /// receive buffer's capacity.
    pub fn truncated(&self) -> Option<(Status, usize)> {
        match &*self.0 {
            ErrorDetail::Truncated { status, capacity } => Some((*status, *capacity)),
            _ => None,
        }
    }

    /// An I/O error with a description of what was being done.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        ErrorDetail::Io {
            what: what.into(),
            source: std::sync::Arc::new(source),
        }
        .into()
    }

    /// The last OS error (errno) with a description.
    pub fn last_os(what: impl Into<String>) -> Self {
        Self::io(what, std::io::Error::last_os_error())
    }

    pub fn peer_failed(rank: u32, reason: impl Into<String>) -> Self {
        ErrorDetail::PeerFailed {
            rank,
            reason: reason.into(),
        }
        .into()
    }

    pub fn malformed(peer: u32, what: impl Into<String>) -> Self {
        ErrorDetail::Malformed {
            peer,
            what: what.into(),
        }
        .into()
    }

    pub fn invalid(what: impl Into<String>) -> Self {
        ErrorDetail::InvalidArgument(what.into()).into()
    }
}

/// `Result<T, weft::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
