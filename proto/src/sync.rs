//! Atomics and cells, switched to `loom`'s model-checked versions under `--cfg loom`, for the
//! lock-free structures of providers (shm's queues and locks, the soft HCA's rings): the code
//! is written once against these names and checked by loom's models without a change.

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};

#[cfg(loom)]
pub use loom::cell::UnsafeCell;

/// `std`'s `UnsafeCell` with loom's `with`/`with_mut` interface. `repr(transparent)`, so an
/// array of them is one contiguous run of its elements in shared memory.
#[cfg(not(loom))]
#[repr(transparent)]
#[derive(Debug)]
pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub const fn new(v: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(v))
    }
    /// Call `f` with a pointer to the value (loom checks the access under `--cfg loom`).
    #[inline(always)]
    pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }
    /// Call `f` with a mutable pointer to the value.
    #[inline(always)]
    pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}
