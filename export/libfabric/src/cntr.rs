//! Counters (`fi_cntr_open`): the count of completed operations of the kinds an endpoint
//! bound them to (`FI_SEND`, `FI_RECV`, `FI_READ`, `FI_WRITE`, `FI_REMOTE_READ`,
//! `FI_REMOTE_WRITE`), successes and errors apart; reading or waiting on one makes progress
//! (manual progress).

use crate::obj::{addr, close_plain, fid_ops, is_live, live};
use crate::state;
use crate::{err, guard};
use std::os::raw::{c_int, c_void};
use weft_ofi_sys as fi;

#[repr(C)]
pub struct Cntr {
    fid: fi::fid_cntr,
    ops: fi::fi_ops,
    cntr_ops: fi::fi_ops_cntr,
}

/// `fi_cntr_open`: a counter of completions (the only event kind libfabric defines); any
/// wait object is accepted, and waiting spins on progress.
pub(crate) unsafe extern "C" fn open(
    domain: *mut fi::fid_domain,
    attr: *mut fi::fi_cntr_attr,
    out: *mut *mut fi::fid_cntr,
    context: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if out.is_null() || !is_live(addr(domain)) {
            return err(fi::FI_EINVAL);
        }
        // SAFETY: null or the caller's attribute struct.
        if unsafe { attr.as_ref() }.is_some_and(|a| a.events != fi::FI_CNTR_EVENTS_COMP) {
            return err(fi::FI_ENOSYS);
        }
        let mut b = Box::new(Cntr {
            fid: fi::fid_cntr::default(),
            ops: fid_ops(close_plain),
            cntr_ops: fi::fi_ops_cntr {
                size: std::mem::size_of::<fi::fi_ops_cntr>(),
                read: Some(read),
                readerr: Some(readerr),
                add: Some(add),
                set: Some(set),
                wait: Some(wait),
                adderr: Some(adderr),
                seterr: Some(seterr),
            },
        });
        b.fid.fid.fclass = fi::FI_CLASS_CNTR as usize;
        b.fid.fid.context = context;
        let p = live(b);
        state::with(|g| g.cntrs.insert(addr(p), state::Cntr::default()));
        // SAFETY: the leaked box; `out` is non-null.
        unsafe {
            (*p).fid.fid.ops = &mut (*p).ops;
            (*p).fid.ops = &mut (*p).cntr_ops;
            *out = &mut (*p).fid;
        }
        0
    })
}

/// The counter's values after a step of progress (0 for a closed counter).
fn values(c: *mut fi::fid_cntr) -> state::Cntr {
    guard(state::Cntr::default(), || {
        state::with(|g| {
            g.poll();
            g.cntrs.get(&addr(c)).copied().unwrap_or_default()
        })
    })
}

/// Change the counter's values by `f`.
fn change(c: *mut fi::fid_cntr, f: impl FnOnce(&mut state::Cntr)) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        state::with(|g| match g.cntrs.get_mut(&addr(c)) {
            Some(v) => {
                f(v);
                0
            }
            None => err(fi::FI_EINVAL),
        })
    })
}

unsafe extern "C" fn read(c: *mut fi::fid_cntr) -> u64 {
    values(c).value
}
unsafe extern "C" fn readerr(c: *mut fi::fid_cntr) -> u64 {
    values(c).err
}
unsafe extern "C" fn add(c: *mut fi::fid_cntr, v: u64) -> c_int {
    change(c, |x| x.value = x.value.wrapping_add(v))
}
unsafe extern "C" fn set(c: *mut fi::fid_cntr, v: u64) -> c_int {
    change(c, |x| x.value = v)
}
unsafe extern "C" fn adderr(c: *mut fi::fid_cntr, v: u64) -> c_int {
    change(c, |x| x.err = x.err.wrapping_add(v))
}
unsafe extern "C" fn seterr(c: *mut fi::fid_cntr, v: u64) -> c_int {
    change(c, |x| x.err = v)
}

/// `fi_cntr_wait`: progress until the counter reaches `threshold` (0), an error is counted
/// (`-FI_EAVAIL`), or `timeout` ms pass (`-FI_ETIMEDOUT`; < 0: no limit).
unsafe extern "C" fn wait(c: *mut fi::fid_cntr, threshold: u64, timeout: c_int) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if !is_live(addr(c)) {
            return err(fi::FI_EINVAL);
        }
        let errs = values(c).err;
        let t0 = std::time::Instant::now();
        loop {
            let v = values(c);
            if v.value >= threshold {
                return 0;
            }
            if v.err != errs {
                return err(fi::FI_EAVAIL as u64);
            }
            if timeout >= 0 && t0.elapsed() >= std::time::Duration::from_millis(timeout as u64) {
                return err(fi::FI_ETIMEDOUT);
            }
            std::thread::yield_now();
        }
    })
}
