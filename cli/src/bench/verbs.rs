//! Raw verbs tests of `weft bench` (perftest's definitions) on the device `WEFT_VERBS_DEVICE`
//! names, and their Cross-Memory Attach references. Ranks 0 and 1 connect one RC QP pair; the
//! job's provider carries only the set-up exchange (as perftest's TCP side channel does).

use super::rank::scaled;
use super::tests::Test;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};
use weft::{Comm, DynProvider, Error, Result};
use weft_verbs::*;

const SPIN: Duration = Duration::from_secs(60);

fn stuck(what: &str) -> Error {
    Error::invalid(format!(
        "verbs bench: no progress for {} s waiting for {what}",
        SPIN.as_secs()
    ))
}

/// What each side tells the other: endpoint, receive buffer address and key, pid.
fn exchange(c: &Comm<DynProvider>, mine: String) -> Result<String> {
    let peer = 1 - c.rank();
    let mut buf = vec![0u8; 256];
    let out = mine.into_bytes();
    if c.rank() == 0 {
        c.send(&out, peer, 77)?;
        let st = c.recv(&mut buf, peer, 77)?;
        buf.truncate(st.bytes);
    } else {
        let st = c.recv(&mut buf, peer, 77)?;
        buf.truncate(st.bytes);
        c.send(&out, peer, 77)?;
    }
    String::from_utf8(buf).map_err(|_| Error::invalid("verbs bench: bad exchange"))
}

fn last(p: *mut u8) -> &'static AtomicU8 {
    // SAFETY: `p` is the last byte of a buffer that lives until the end of the job; the peer
    // writes it through the HCA or the kernel, we only load it atomically.
    unsafe { AtomicU8::from_ptr(p) }
}

struct Conn {
    hca: std::sync::Arc<dyn Hca>,
    cq: Cq,
    qp: Qp,
    smr: Mr,
    rmr: Mr,
    rbuf: *mut u8,
    remote_addr: u64,
    rkey: u32,
    _keep: (Vec<u8>, Vec<u8>),
    sent: u64,
    /// Receives posted and not yet completed.
    recvs: std::cell::Cell<usize>,
    /// Completions polled while waiting for another kind, by opcode.
    seen: std::cell::RefCell<Banked>,
}

/// Completions reaped but not yet waited for, counted by opcode.
#[derive(Default)]
struct Banked([u64; 7]);

fn slot(op: WcOpcode) -> usize {
    match op {
        WcOpcode::Send => 0,
        WcOpcode::RdmaWrite => 1,
        WcOpcode::RdmaRead => 2,
        WcOpcode::CompSwap => 3,
        WcOpcode::FetchAdd => 4,
        WcOpcode::Recv => 5,
        WcOpcode::RecvRdmaWithImm => 6,
    }
}

/// Wait for one successful completion of `op` from `poll` (which fills at most one entry),
/// first taking one banked by an earlier wait; a failed completion is an error, and no
/// progress for `limit` is one too.
fn reap(
    mut poll: impl FnMut(&mut [Wc]) -> Result<usize>,
    seen: &mut Banked,
    op: WcOpcode,
    limit: Duration,
) -> Result<()> {
    if seen.0[slot(op)] > 0 {
        seen.0[slot(op)] -= 1;
        return Ok(());
    }
    let t0 = Instant::now();
    let mut w = [Wc::EMPTY; 1];
    loop {
        if poll(&mut w)? == 1 {
            if w[0].status != WcStatus::Success {
                return Err(Error::invalid(format!(
                    "verbs bench: completion {:?}",
                    w[0]
                )));
            }
            if w[0].opcode == op {
                return Ok(());
            }
            seen.0[slot(w[0].opcode)] += 1;
        } else if t0.elapsed() > limit {
            return Err(Error::invalid(format!(
                "verbs bench: no progress for {} s waiting for a {op:?} completion",
                limit.as_secs_f64()
            )));
        }
    }
}

impl Conn {
    fn open(c: &Comm<DynProvider>, max: usize, dm: bool, depth: u32) -> Result<Conn> {
        let hca = weft_verbs::open_default()?;
        let pd = hca.alloc_pd()?;
        let cq = hca.create_cq(4 * depth + 16)?;
        let qp = hca.create_qp(
            pd,
            &QpInitAttr {
                qp_type: QpType::Rc,
                send_cq: cq,
                recv_cq: cq,
                srq: None,
                cap: QpCap {
                    max_send_wr: depth,
                    max_recv_wr: 2 * depth,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 64,
                },
                sq_sig_all: false,
            },
        )?;
        let mut sbuf = touched(max);
        let mut rbuf = touched(if dm { 0 } else { max });
        // SAFETY: both buffers live in the Conn until the job ends; nothing borrows them.
        let smr = unsafe { hca.reg_mr(pd, sbuf.as_mut_ptr(), max, Access::ALL) }?;
        let (rp, rmr) = if dm {
            let d = hca.alloc_dm(max)?;
            // SAFETY: device memory of this HCA, never freed before the job ends.
            (d.ptr, unsafe { hca.reg_mr(pd, d.ptr, max, Access::ALL) }?)
        } else {
            let p = rbuf.as_mut_ptr();
            // SAFETY: as above.
            (p, unsafe { hca.reg_mr(pd, p, max, Access::ALL) }?)
        };
        let me = Endpoint::of(&*hca, qp, 1 + c.rank());
        let peer = exchange(c, format!("{me} {:x} {:x}", rmr.addr, rmr.rkey))?;
        let mut it = peer.split(' ');
        let ep: Endpoint = it.next().unwrap_or("").parse()?;
        let num = |s: Option<&str>| {
            s.and_then(|x| u64::from_str_radix(x, 16).ok())
                .ok_or_else(|| Error::invalid("verbs bench: bad exchange"))
        };
        let (ra, rk) = (num(it.next())?, num(it.next())? as u32);
        connect_rc(&*hca, qp, 1 + c.rank(), &ep, &RcParams::default())?;
        c.barrier()?;
        Ok(Conn {
            hca,
            cq,
            qp,
            smr,
            rmr,
            rbuf: rp,
            remote_addr: ra,
            rkey: rk,
            _keep: (sbuf, rbuf),
            sent: 0,
            recvs: std::cell::Cell::new(0),
            seen: Default::default(),
        })
    }

    /// Post, signaling every 32nd request so the send queue drains on real hardware too;
    /// reap those completions as they come.
    fn post(&mut self, mut wr: SendWr) -> Result<()> {
        self.sent += 1;
        wr.signaled = self.sent % 32 == 0;
        self.hca.post_send(self.qp, &[wr])
    }

    /// Post receives (each the whole buffer, so that any size fits) until `n` are posted.
    fn top_up(&self, n: usize) -> Result<()> {
        while self.recvs.get() < n {
            self.hca
                .post_recv(self.qp, &[RecvWr::new(1, &[self.rmr.sge(0, self.rmr.len)])])?;
            self.recvs.set(self.recvs.get() + 1);
        }
        Ok(())
    }

    /// Wait for one completion of `op`. A completion of another kind that arrives first is
    /// banked for a later wait: on one completion queue the peer's answer (a receive) can
    /// land before our own send's completion, and dropping it would wait forever.
    fn wait(&self, op: WcOpcode) -> Result<()> {
        let hca = &self.hca;
        let cq = self.cq;
        let recvs = &self.recvs;
        let mut seen = self.seen.borrow_mut();
        reap(
            |w| {
                let n = hca.poll_cq(cq, w)?;
                if n == 1 && w[0].opcode == WcOpcode::Recv && w[0].status == WcStatus::Success {
                    recvs.set(recvs.get() - 1);
                }
                Ok(n)
            },
            &mut seen,
            op,
            SPIN,
        )
    }

    /// Spin until the last byte of our receive buffer (`size` long) reads `v`.
    fn poll_last(&self, size: usize, v: u8) -> Result<()> {
        // SAFETY: within the registered receive buffer.
        let b = last(unsafe { self.rbuf.add(size - 1) });
        let t0 = Instant::now();
        let mut n = 0u32;
        while b.load(Ordering::Acquire) != v {
            n = n.wrapping_add(1);
            if n % 64 == 0 {
                self.hca.progress();
                if t0.elapsed() > SPIN {
                    return Err(stuck("the peer's write"));
                }
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    fn set_last(&self, size: usize, v: u8) {
        // SAFETY: the last byte of our registered send buffer; no request reads it right now
        // (every earlier write has landed, as the ping-pong proves).
        unsafe { *(self.smr.addr as *mut u8).add(size - 1) = v };
    }
}

/// One measurement of `t` at `size`; rank 0's value is what the job prints.
pub fn measure(
    c: &Comm<DynProvider>,
    t: Test,
    sizes: &[usize],
    iters: usize,
    warmup: usize,
    window: usize,
) -> Result<Vec<(usize, f64)>> {
    let max = sizes.iter().copied().max().unwrap_or(8).max(8);
    let me = c.rank();
    let mut out = vec![];
    if matches!(t, Test::CmaWriteLat | Test::CmaWriteBw) {
        return cma(c, t, sizes, iters, warmup, window);
    }
    let depth = (window.max(1) as u32).clamp(64, 1024);
    let mut k = Conn::open(c, max, t == Test::VerbsWriteLatDm, depth)?;
    for &size in sizes {
        let size = size.max(1);
        let (raddr, rkey) = (k.remote_addr, k.rkey);
        let v = match t {
            Test::VerbsSendLat => {
                let (n, warmup) = (
                    scaled(iters, size, 512 << 20, 20),
                    scaled(warmup, size, 64 << 20, 2),
                );
                let mut t0 = Instant::now();
                k.top_up(2)?;
                for i in 0..warmup + n {
                    if i == warmup {
                        t0 = Instant::now();
                    }
                    if me == 0 {
                        k.post(SendWr::send(0, &[k.smr.sge(0, size)]))?;
                        k.wait(WcOpcode::Recv)?;
                        k.top_up(2)?;
                    } else {
                        k.wait(WcOpcode::Recv)?;
                        k.top_up(2)?;
                        k.post(SendWr::send(0, &[k.smr.sge(0, size)]))?;
                    }
                }
                t0.elapsed().as_secs_f64() * 1e6 / n as f64 / 2.0
            }
            Test::VerbsWriteLat | Test::VerbsWriteLatDm => {
                let (n, warmup) = (
                    scaled(iters, size, 512 << 20, 20),
                    scaled(warmup, size, 64 << 20, 2),
                );
                let mut t0 = Instant::now();
                for i in 0..warmup + n {
                    if i == warmup {
                        t0 = Instant::now();
                    }
                    let v = (i % 255) as u8 + 1;
                    if me == 1 {
                        k.poll_last(size, v)?;
                    }
                    k.set_last(size, v);
                    k.post(SendWr::write(0, &[k.smr.sge(0, size)], raddr, rkey))?;
                    if k.sent % 32 == 0 {
                        // The signaled one: reap it, so the send queue drains as on hardware.
                        k.wait(WcOpcode::RdmaWrite)?;
                    }
                    if me == 0 {
                        k.poll_last(size, v)?;
                    }
                }
                t0.elapsed().as_secs_f64() * 1e6 / n as f64 / 2.0
            }
            Test::VerbsReadLat | Test::VerbsAtomicLat => {
                let (n, warmup) = (
                    scaled(iters, size, 512 << 20, 20),
                    scaled(warmup, size, 64 << 20, 2),
                );
                let mut t0 = Instant::now();
                if me == 0 {
                    for i in 0..warmup + n {
                        if i == warmup {
                            t0 = Instant::now();
                        }
                        let wr = if t == Test::VerbsReadLat {
                            SendWr::read(0, &[k.smr.sge(0, size)], raddr, rkey)
                        } else {
                            SendWr::fetch_add(0, k.smr.sge(0, 8), raddr, rkey, 1)
                        };
                        k.hca.post_send(k.qp, &[wr])?;
                        k.wait(if t == Test::VerbsReadLat {
                            WcOpcode::RdmaRead
                        } else {
                            WcOpcode::FetchAdd
                        })?;
                    }
                }
                c.barrier()?;
                t0.elapsed().as_secs_f64() * 1e6 / n as f64
            }
            Test::VerbsWriteBw | Test::VerbsSendBw => {
                let w = window.clamp(1, depth as usize);
                let (n, warmup) = (
                    scaled(iters, size * w, 2 << 30, 3),
                    scaled(warmup, size * w, 256 << 20, 1),
                );
                let send = t == Test::VerbsSendBw;
                let mut t0 = Instant::now();
                if send {
                    k.top_up(if me == 1 { 2 * w } else { 1 })?;
                }
                for r in 0..warmup + n {
                    if r == warmup {
                        t0 = Instant::now();
                    }
                    if me == 0 {
                        for j in 0..w {
                            let mut wr = if send {
                                SendWr::send(0, &[k.smr.sge(0, size)])
                            } else {
                                SendWr::write(0, &[k.smr.sge(0, size)], raddr, rkey)
                            };
                            wr.signaled = j + 1 == w;
                            k.hca.post_send(k.qp, &[wr])?;
                        }
                        k.wait(if send {
                            WcOpcode::Send
                        } else {
                            WcOpcode::RdmaWrite
                        })?;
                        if send {
                            k.wait(WcOpcode::Recv)?;
                            k.top_up(1)?;
                        }
                    } else if send {
                        for _ in 0..w {
                            k.wait(WcOpcode::Recv)?;
                        }
                        k.top_up(2 * w)?;
                        k.post(SendWr::send(0, &[k.smr.sge(0, 1)]))?;
                    }
                }
                let dt = t0.elapsed().as_secs_f64();
                c.barrier()?;
                (size * w * n) as f64 / dt / 1e6
            }
            _ => return Err(Error::invalid(format!("{} is not a verbs test", t.name()))),
        };
        out.push((size, v));
        c.barrier()?;
    }
    Ok(out)
}

/// The Cross-Memory Attach references: what the soft HCA's user-memory path is built on.
fn cma(
    c: &Comm<DynProvider>,
    t: Test,
    sizes: &[usize],
    iters: usize,
    warmup: usize,
    window: usize,
) -> Result<Vec<(usize, f64)>> {
    use weft_provider::cma::{copy, Dir, Range};
    let max = sizes.iter().copied().max().unwrap_or(8).max(8);
    let me = c.rank();
    let sbuf = touched(max);
    let rbuf = touched(max);
    let peer = exchange(
        c,
        format!("{} {:x}", std::process::id(), rbuf.as_ptr() as u64),
    )?;
    let mut it = peer.split(' ');
    let pid: i32 = it.next().and_then(|x| x.parse().ok()).unwrap_or(0);
    let raddr = it
        .next()
        .and_then(|x| u64::from_str_radix(x, 16).ok())
        .unwrap_or(0);
    let push = |size: usize| -> Result<()> {
        let l = [Range {
            base: sbuf.as_ptr() as u64,
            len: size,
        }];
        let r = [Range {
            base: raddr,
            len: size,
        }];
        // SAFETY: our send buffer is read; the peer's receive buffer lives until the final
        // barrier, and the kernel checks the peer's addresses.
        unsafe { copy(pid, Dir::Push, &l, &r, size) }
            .map(|_| ())
            .map_err(|e| Error::invalid(format!("process_vm_writev: {e}")))
    };
    c.barrier()?;
    let mut out = vec![];
    for &size in sizes {
        let size = size.max(1);
        let v = if t == Test::CmaWriteLat {
            let (n, warmup) = (
                scaled(iters, size, 512 << 20, 20),
                scaled(warmup, size, 64 << 20, 2),
            );
            let lb = last(rbuf.as_ptr().wrapping_add(size - 1) as *mut u8);
            let wait = |v: u8| -> Result<()> {
                let t0 = Instant::now();
                while lb.load(Ordering::Acquire) != v {
                    if t0.elapsed() > SPIN {
                        return Err(stuck("the peer's write"));
                    }
                    std::hint::spin_loop();
                }
                Ok(())
            };
            let mut t0 = Instant::now();
            for i in 0..warmup + n {
                if i == warmup {
                    t0 = Instant::now();
                }
                let v = (i % 255) as u8 + 1;
                // SAFETY: the last byte of our own send buffer, read by the kernel only
                // during our own push below.
                unsafe { *(sbuf.as_ptr().add(size - 1) as *mut u8) = v };
                if me == 0 {
                    push(size)?;
                    wait(v)?;
                } else {
                    wait(v)?;
                    push(size)?;
                }
            }
            t0.elapsed().as_secs_f64() * 1e6 / n as f64 / 2.0
        } else {
            let w = window.max(1);
            let (n, warmup) = (
                scaled(iters, size * w, 2 << 30, 3),
                scaled(warmup, size * w, 256 << 20, 1),
            );
            let mut t0 = Instant::now();
            if me == 0 {
                for r in 0..warmup + n {
                    if r == warmup {
                        t0 = Instant::now();
                    }
                    for _ in 0..w {
                        push(size)?;
                    }
                }
            }
            let dt = t0.elapsed().as_secs_f64();
            c.barrier()?;
            (size * w * n) as f64 / dt / 1e6
        };
        out.push((size, v));
        c.barrier()?;
    }
    Ok(out)
}

/// A benchmark buffer of `len` zero bytes whose every page is this process's own: `vec![0; n]`
/// is calloc'd memory that maps the kernel's shared zero page until written, so a transfer
/// *from* it reads one cached page over and over and measures nothing real.
fn touched(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let base = v.as_ptr() as usize;
    // One store in every page the vector touches: its first byte, then each page start.
    let mut i = 0;
    while i < len {
        // SAFETY: a byte of our own vector (i < len); volatile so that the store of an
        // unchanged value is not optimised away.
        unsafe { std::ptr::write_volatile(v.as_mut_ptr().add(i), 0) };
        i = ((base + i) / 4096 + 1) * 4096 - base;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every page of `b` is present and mapped by this process alone (pagemap bits 63 and 56):
    /// not absent, not the shared zero page.
    fn own_pages(b: &[u8]) -> bool {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open("/proc/self/pagemap").expect("pagemap");
        (b.as_ptr() as usize / 4096..=(b.as_ptr() as usize + b.len() - 1) / 4096).all(|pg| {
            let mut e = [0u8; 8];
            f.seek(SeekFrom::Start(pg as u64 * 8)).unwrap();
            f.read_exact(&mut e).unwrap();
            let e = u64::from_le_bytes(e);
            e & (1 << 63) != 0 && e & (1 << 56) != 0
        })
    }

    #[test]
    fn benchmark_buffers_are_real_memory() {
        let b = touched(4 << 20);
        // A read of every page (what a transfer from it does) must not change the answer.
        assert_eq!(b.iter().step_by(4096).map(|x| *x as u64).sum::<u64>(), 0);
        assert!(
            own_pages(&b),
            "a benchmark buffer is (partly) the zero page"
        );
    }

    fn wc(opcode: WcOpcode, status: WcStatus) -> Wc {
        Wc {
            wr_id: 0,
            status,
            opcode,
            byte_len: 0,
            imm: None,
            qp_num: 0,
            src_qp: 0,
            grh: false,
        }
    }

    /// A poll that hands out `script` one completion at a time, then nothing.
    fn scripted(script: Vec<Wc>) -> impl FnMut(&mut [Wc]) -> Result<usize> {
        let mut it = script.into_iter();
        move |w: &mut [Wc]| {
            Ok(match it.next() {
                Some(c) => {
                    w[0] = c;
                    1
                }
                None => 0,
            })
        }
    }

    /// The peer's answer reaped while waiting for our own send completion is kept for the
    /// wait that wants it (before the fix it was dropped and `verbs_send_bw` waited 60 s and
    /// failed on a loaded CI machine).
    #[test]
    fn a_completion_that_arrives_early_is_kept_for_its_wait() {
        let mut poll = scripted(vec![
            wc(WcOpcode::Recv, WcStatus::Success),
            wc(WcOpcode::Send, WcStatus::Success),
        ]);
        let mut seen = Banked::default();
        let limit = Duration::from_millis(200);
        reap(&mut poll, &mut seen, WcOpcode::Send, limit).unwrap();
        reap(&mut poll, &mut seen, WcOpcode::Recv, limit).unwrap();
        // Nothing more is banked: a third wait runs into the limit and says what it waited for.
        let e = reap(&mut poll, &mut seen, WcOpcode::Recv, limit).unwrap_err();
        assert!(e.to_string().contains("Recv completion"), "{e}");
    }

    #[test]
    fn a_failed_completion_is_an_error_naming_it() {
        let mut poll = scripted(vec![wc(WcOpcode::Send, WcStatus::RnrRetryExcErr)]);
        let e = reap(
            &mut poll,
            &mut Banked::default(),
            WcOpcode::Send,
            Duration::from_millis(200),
        )
        .unwrap_err();
        assert!(e.to_string().contains("RnrRetryExcErr"), "{e}");
    }
}
