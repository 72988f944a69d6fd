//! The provider conformance suite, in the spirit of libfabric's fabtests: collective checks
//! that any provider — built in or loaded from a library — must pass, grouped as `two-sided`,
//! `datatypes`, `rma`, `atomics` and `stress`. Every rank runs [`run`]; the outcome of each
//! check is agreed by all ranks (a check fails if it failed anywhere).
//!
//! `weft test --provider NAME [--provider-path DIR] [-n RANKS]` runs it across processes and
//! prints a table; `weft_testing::world_dyn` runs it in-process.
//!
//! Size (over 800 lines): the suite is one list of checks run in the same order on every rank; its
//! groups share the agreement and reporting code.

use weft::{
    Assert, Comm, Datatype, DynProvider, Element, ErrorKind, LockKind, Op, SharedBuf, WinInfo,
    Window, ANY_SOURCE, ANY_TAG,
};

/// The C example provider (`libweft-cdgram.so`) and its deliberately faulty twin
/// (`libweft-faulty.so`), built by this crate's build script.
pub const CDGRAM_DIR: &str = concat!(env!("OUT_DIR"), "/c");
/// Broken provider libraries for the loader tests.
pub const BROKEN_DIR: &str = concat!(env!("OUT_DIR"), "/broken");

/// The outcome of one check.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub group: &'static str,
    pub test: &'static str,
    pub ok: bool,
    pub detail: String,
}

impl Outcome {
    /// One line for a rank to print and a launcher to read back: `CHECK <ok> <group>\t<test>\t<detail>`
    /// (the detail with newlines and tabs turned into spaces).
    pub fn to_line(&self) -> String {
        let detail: String = self
            .detail
            .chars()
            .map(|c| if c == '\n' || c == '\t' { ' ' } else { c })
            .collect();
        format!(
            "CHECK {} {}\t{}\t{}",
            if self.ok { "pass" } else { "fail" },
            self.group,
            self.test,
            detail
        )
    }

    /// Read a line written by [`Outcome::to_line`]; `None` for any other line or an unknown check.
    pub fn from_line(line: &str) -> Option<Outcome> {
        let rest = line.strip_prefix("CHECK ")?;
        let (ok, rest) = rest.split_once(' ')?;
        let mut f = rest.splitn(3, '\t');
        let (g, t, d) = (f.next()?, f.next()?, f.next().unwrap_or(""));
        let &(group, test, _) = CHECKS.iter().find(|(cg, ct, _)| *cg == g && *ct == t)?;
        let ok = match ok {
            "pass" => true,
            "fail" => false,
            _ => return None,
        };
        Some(Outcome {
            group,
            test,
            ok,
            detail: d.to_string(),
        })
    }
}

/// The names of the groups, in order.
pub fn groups() -> Vec<&'static str> {
    let mut g: Vec<&'static str> = CHECKS.iter().map(|c| c.0).collect();
    g.dedup();
    g
}

pub type Check = fn(&Comm<DynProvider>) -> Result<(), String>;

/// Every check, by group.
pub const CHECKS: &[(&str, &str, Check)] = &[
    ("two-sided", "sizes 0 B to 16 MiB", sizes),
    ("two-sided", "wildcards", wildcards),
    ("two-sided", "non-overtaking order", ordering),
    ("two-sided", "truncation", truncation),
    ("two-sided", "probe and cancel", probe_cancel),
    ("two-sided", "synchronous send", ssend),
    ("two-sided", "a window into one buffer", shared_window),
    ("datatypes", "vector, indexed, struct", datatypes),
    ("rma", "fence put/get", rma_fence),
    ("rma", "post-start-complete-wait", rma_pscw),
    ("rma", "locks and flush", rma_locks),
    ("rma", "request-based operations", rma_requests),
    (
        "atomics",
        "every op and type against an oracle",
        atomics_oracle,
    ),
    (
        "atomics",
        "contended: every rank on one element",
        atomics_contended,
    ),
    ("stress", "many outstanding operations", outstanding),
    ("stress", "all-pairs traffic", all_pairs),
];

// A failed expectation is recorded and the check goes on, so that the communication pattern
// stays the same on every rank and the peers of a failing rank are not left waiting.
macro_rules! ensure {
    ($c:expr, $($m:tt)*) => {
        if !$c {
            note(format!($($m)*));
        }
    };
}

thread_local! {
    static FIRST_FAILURE: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Record a failed expectation of the running check (the first one is kept).
fn note(why: String) {
    FIRST_FAILURE.with(|f| {
        f.borrow_mut().get_or_insert(why);
    });
}

fn w<T>(r: weft::Result<T>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

/// Run every check (or those of `group`); collective.
pub fn run(c: &Comm<DynProvider>, group: Option<&str>) -> Vec<Outcome> {
    run_with(c, group, |_| {})
}

/// [`run`], calling `each` with every outcome as soon as all ranks agree on it.
pub fn run_with(
    c: &Comm<DynProvider>,
    group: Option<&str>,
    mut each: impl FnMut(&Outcome),
) -> Vec<Outcome> {
    let mut out = vec![];
    for (g, name, f) in CHECKS {
        if group.is_some_and(|x| x != *g) {
            continue;
        }
        FIRST_FAILURE.with(|f| f.borrow_mut().take());
        // Every check runs in a communicator of its own, so that messages a failed check
        // left behind cannot match in the next one.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&w(c.dup())?)))
            .unwrap_or_else(|_| Err("the check panicked".into()));
        let r = match FIRST_FAILURE.with(|f| f.borrow_mut().take()) {
            Some(why) => Err(why),
            None => r,
        };
        let mine = r.is_ok() as u32;
        let mut all = [0u32];
        let reduced = c.allreduce(&[mine], &mut all, Op::Min);
        let agreed = reduced.is_ok() && all[0] == 1;
        let mut detail = r.err().unwrap_or_default();
        match reduced {
            Ok(()) if !agreed => detail = gather_details(c, &detail),
            Ok(()) => {}
            // A failed check always says why, even when the ranks cannot compare notes.
            Err(e) if detail.is_empty() => {
                detail = format!("the ranks could not agree on the outcome: {e}")
            }
            Err(_) => {}
        }
        out.push(Outcome {
            group: g,
            test: name,
            ok: agreed,
            detail,
        });
        each(out.last().expect("just pushed"));
        // Keep checks apart even after a failure.
        let _ = c.barrier();
    }
    out
}

/// On rank 0: every rank's reason for a failed check, as "rank r: why; ...".
fn gather_details(c: &Comm<DynProvider>, mine: &str) -> String {
    const TAG: i32 = 0x7eed;
    if c.rank() != 0 {
        let _ = c.send(mine.as_bytes(), 0, TAG);
        return mine.to_string();
    }
    let mut all = vec![];
    if !mine.is_empty() {
        all.push(format!("rank 0: {mine}"));
    }
    for src in 1..c.size() {
        let Ok(st) = c.probe(src, TAG) else { break };
        let mut b = vec![0u8; st.bytes];
        if c.recv(&mut b, src, TAG).is_ok() && !b.is_empty() {
            all.push(format!("rank {src}: {}", String::from_utf8_lossy(&b)));
        }
    }
    all.join("; ")
}

fn sizes(c: &Comm<DynProvider>) -> Result<(), String> {
    let (r, n) = (c.rank(), c.size());
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    for (i, &size) in [0usize, 1, 8, 1000, 65_536, 1 << 20, 16 << 20]
        .iter()
        .enumerate()
    {
        let data = pattern(size, i as u8 + r as u8);
        let mut got = vec![0u8; size];
        let st = w(c.sendrecv(&data, right, i as i32, &mut got, left, i as i32))?;
        ensure!(
            st.bytes == size && st.source == left,
            "{size} B: status {st:?}"
        );
        ensure!(
            got == pattern(size, i as u8 + left as u8),
            "{size} B: payload differs"
        );
    }
    Ok(())
}

fn wildcards(c: &Comm<DynProvider>) -> Result<(), String> {
    let (r, n) = (c.rank(), c.size());
    if r == 0 {
        let mut seen = vec![false; n as usize];
        for _ in 1..n {
            let mut b = [0u32];
            let st = w(c.recv(&mut b, ANY_SOURCE, ANY_TAG))?;
            ensure!(
                b[0] == st.source && st.tag == 40 + st.source as i32,
                "wrong source/tag {st:?}"
            );
            seen[st.source as usize] = true;
        }
        ensure!(seen[1..].iter().all(|x| *x), "a source is missing");
    } else {
        w(c.send(&[r], 0, 40 + r as i32))?;
    }
    Ok(())
}

fn ordering(c: &Comm<DynProvider>) -> Result<(), String> {
    let r = c.rank();
    let sizes = [4usize, 100_000, 1, 300_000, 0, 9_000, 2];
    if r == 0 {
        for (i, s) in sizes.iter().enumerate() {
            let mut d = pattern(*s, 3);
            if *s > 0 {
                d[0] = i as u8;
            }
            w(c.send(&d, 1, 9))?;
        }
    } else if r == 1 {
        for (i, s) in sizes.iter().enumerate() {
            let mut b = vec![0u8; 300_000];
            let st = w(c.recv(&mut b, if i % 2 == 0 { 0u32.into() } else { ANY_SOURCE }, 9))?;
            ensure!(
                st.bytes == *s,
                "message {i} out of order: {} bytes",
                st.bytes
            );
            ensure!(
                *s == 0 || b[0] == i as u8,
                "message {i} has the wrong payload"
            );
        }
    }
    Ok(())
}

fn truncation(c: &Comm<DynProvider>) -> Result<(), String> {
    for (tag, n) in [(1, 50usize), (2, 200_000)] {
        if c.rank() == 0 {
            w(c.send(&pattern(n, 5), 1, tag))?;
        } else if c.rank() == 1 {
            let mut b = [0xAAu8; 32];
            match c.recv(&mut b[..16], 0, tag) {
                Ok(st) => note(format!("truncation was not reported: {st:?}")),
                Err(e) => ensure!(e.kind() == ErrorKind::Truncated, "wrong error: {e}"),
            }
            ensure!(b[16..].iter().all(|x| *x == 0xAA), "wrote past the buffer");
            ensure!(
                b[..16] == pattern(n, 5)[..16],
                "the received prefix differs"
            );
        }
    }
    Ok(())
}

/// Windows of receives posted into one buffer (OSU's and ucx_perftest's bandwidth tests do
/// this): every receive completes with its own status, and identical messages leave the buffer
/// holding that message, whichever protocol (eager, rendezvous, direct placement) carried them.
fn shared_window(c: &Comm<DynProvider>) -> Result<(), String> {
    const WINDOW: usize = 16;
    for (i, size) in [8usize, 100_000, 1 << 20].into_iter().enumerate() {
        let tag = 60 + i as i32;
        if c.rank() == 0 {
            let data = pattern(size, i as u8);
            c.scope(|s| -> Result<(), String> {
                let reqs = (0..WINDOW)
                    .map(|_| w(c.isend(s, &data, 1, tag)))
                    .collect::<Result<Vec<_>, _>>()?;
                w(weft::waitall(reqs))?;
                Ok(())
            })?;
        } else if c.rank() == 1 {
            // One byte more than a message: each status must report the message's length.
            let mut buf = SharedBuf::new(size + 1);
            let sts = c.scope(|s| -> Result<Vec<weft::Status>, String> {
                let reqs = (0..WINDOW)
                    .map(|_| w(c.irecv_shared(s, &buf, 0, tag)))
                    .collect::<Result<Vec<_>, _>>()?;
                w(weft::waitall(reqs))
            })?;
            ensure!(
                sts.iter()
                    .all(|st| st.bytes == size && st.source == 0 && st.tag == tag),
                "{size} B: statuses {sts:?}"
            );
            let got = buf.as_mut_slice();
            let want = pattern(size, i as u8);
            if let Some(at) = (0..size).find(|&k| got[k] != want[k]) {
                let end = (at..size).find(|&k| got[k] == want[k]).unwrap_or(size);
                // Recorded, not returned: the sender goes on to the next size.
                note(format!(
                    "{size} B: the buffer does not hold the message: bytes {at}..{end} differ \
                     (first {:#04x}, expected {:#04x})",
                    got[at], want[at]
                ));
            }
            ensure!(got[size] == 0, "{size} B: a byte written past the message");
        }
    }
    Ok(())
}

fn probe_cancel(c: &Comm<DynProvider>) -> Result<(), String> {
    if c.rank() == 0 {
        w(c.send(&pattern(4321, 1), 1, 7))?;
    } else if c.rank() == 1 {
        let st = w(c.probe(0, 7))?;
        ensure!(st.bytes == 4321, "probe says {} bytes", st.bytes);
        let mut b = vec![0u8; st.bytes];
        w(c.recv(&mut b, 0, 7))?;
        ensure!(
            w(c.iprobe(0, 77))?.is_none(),
            "iprobe found a message nobody sent"
        );
        let mut never = [0u8; 8];
        let cancelled = c.scope(|s| -> Result<bool, String> {
            let mut r = w(c.irecv(s, &mut never, 0, 78))?;
            w(r.cancel())?;
            Ok(w(r.wait())?.cancelled)
        })?;
        ensure!(cancelled, "the receive was not cancelled");
    }
    Ok(())
}

fn ssend(c: &Comm<DynProvider>) -> Result<(), String> {
    if c.rank() == 0 {
        w(c.ssend(&pattern(70_000, 2), 1, 3))?;
        w(c.ssend(&[1u8], 1, 4))?;
    } else if c.rank() == 1 {
        let mut b = vec![0u8; 70_000];
        w(c.recv(&mut b, 0, 3))?;
        ensure!(b == pattern(70_000, 2), "payload differs");
        w(c.recv(&mut b[..1], 0, 4))?;
    }
    Ok(())
}

fn datatypes(c: &Comm<DynProvider>) -> Result<(), String> {
    if c.rank() > 1 {
        return Ok(());
    }
    let f = Datatype::of::<f64>();
    let col = w(Datatype::vector(500, 1, 3, &f))?.commit();
    let idx = w(Datatype::indexed(
        &[2, 1, 3],
        &[0, 5, 9],
        &Datatype::of::<u32>(),
    ))?
    .commit();
    let st = w(Datatype::structure(
        &[1, 2],
        &[0, 8],
        &[Datatype::of::<u8>(), Datatype::of::<f64>()],
    ))?
    .commit();
    if c.rank() == 0 {
        let m: Vec<f64> = (0..1500).map(|i| i as f64 * 0.5).collect();
        w(c.send_typed(bytemuck::cast_slice(&m), 1, &col, 1, 1))?;
        let u: Vec<u32> = (0..12).collect();
        w(c.send_typed(bytemuck::cast_slice(&u), 1, &idx, 1, 2))?;
        let mut s = [0u8; 24];
        s[0] = 9;
        s[8..16].copy_from_slice(&1.5f64.to_le_bytes());
        s[16..24].copy_from_slice(&(-2.0f64).to_le_bytes());
        w(c.send_typed(&s, 1, &st, 1, 3))?;
    } else {
        let mut v = vec![0f64; 500];
        w(c.recv(&mut v, 0, 1))?;
        ensure!(
            v.iter()
                .enumerate()
                .all(|(i, x)| *x == (3 * i) as f64 * 0.5),
            "vector payload"
        );
        let mut u = [0u32; 12];
        w(c.recv_typed(bytemuck::cast_slice_mut(&mut u), 1, &idx, 0, 2))?;
        ensure!(
            u == [0, 1, 0, 0, 0, 5, 0, 0, 0, 9, 10, 11],
            "indexed payload {u:?}"
        );
        let mut s = [0u8; 24];
        w(c.recv_typed(&mut s, 1, &st, 0, 3))?;
        ensure!(
            s[0] == 9 && s[8..16] == 1.5f64.to_le_bytes(),
            "struct payload"
        );
    }
    Ok(())
}

/// Run `f` on a window holding `mem`'s values: allocated by the library (`alloc`) or created
/// over `mem`. Collective; the window is freed before this returns.
fn with_win<T: Element, R>(
    c: &Comm<DynProvider>,
    mem: &mut [T],
    info: WinInfo,
    alloc: bool,
    f: impl FnOnce(&Window<'_, DynProvider>) -> Result<R, String>,
) -> Result<R, String> {
    if alloc {
        let win = w(c.win_allocate::<T>(mem.len(), info))?;
        w(win.write_local(0, mem))?;
        w(c.barrier())?;
        let r = f(&win);
        let freed = w(win.free());
        let v = r?;
        freed?;
        Ok(v)
    } else {
        let mut out = None;
        w(c.win_create(mem, info, |win| {
            out = Some(f(win));
            Ok(())
        }))?;
        out.unwrap_or_else(|| Err("the window closure did not run".into()))
    }
}

fn rma_fence(c: &Comm<DynProvider>) -> Result<(), String> {
    let (r, n) = (c.rank(), c.size());
    for alloc in [false, true] {
        let mut mem = vec![0u64; n as usize];
        with_win(c, &mut mem, WinInfo::default(), alloc, |win| {
            let v = [r as u64 + 100];
            w(win.fence_epoch(Assert::NONE, |e| {
                for t in 0..n {
                    e.put(&v, t, r as usize)?;
                }
                Ok(())
            }))?;
            let mut mine = vec![0u64; n as usize];
            w(win.read_local(0, &mut mine))?;
            ensure!(
                mine == (0..n as u64).map(|x| x + 100).collect::<Vec<_>>(),
                "after puts: {mine:?}"
            );
            let mut got = vec![0u64; n as usize];
            w(win.fence_epoch(Assert::NONE, |e| e.get(&mut got, (r + 1) % n, 0)))?;
            ensure!(got == mine, "get read {got:?}");
            Ok(())
        })?;
    }
    Ok(())
}

fn rma_pscw(c: &Comm<DynProvider>) -> Result<(), String> {
    let (r, n) = (c.rank(), c.size());
    let (left, right) = ((r + n - 1) % n, (r + 1) % n);
    let mut mem = vec![0i32; 2];
    with_win(c, &mut mem, WinInfo::default(), false, |win| {
        for round in 0..3 {
            w(win.post(&[left]))?;
            let v = [r as i32 * 10 + round];
            w(win.start_epoch(&[right], |e| e.put(&v, right, 0)))?;
            w(win.wait())?;
            let mut m = [0i32; 1];
            w(win.read_local(0, &mut m))?;
            ensure!(m[0] == left as i32 * 10 + round, "round {round}: {}", m[0]);
        }
        Ok(())
    })
}

fn rma_locks(c: &Comm<DynProvider>) -> Result<(), String> {
    let n = c.size();
    for alloc in [false, true] {
        let mut mem = vec![0u64; 1];
        with_win(c, &mut mem, WinInfo::default(), alloc, |win| {
            for _ in 0..3 {
                w(win.lock_epoch(0, LockKind::Exclusive, |e| {
                    let mut v = [0u64];
                    e.local(|l| l.get(&mut v, 0, 0))?;
                    let nv = [v[0] + 1];
                    e.local(|l| l.put(&nv, 0, 0))
                }))?;
            }
            w(c.barrier())?;
            let mut all = vec![0u64; n as usize];
            w(win.lock_all_epoch(|e| {
                e.get(&mut all[..1], 0, 0)?;
                e.flush_all()
            }))?;
            ensure!(
                all[0] == 3 * n as u64,
                "exclusive increments: {} of {}",
                all[0],
                3 * n
            );
            w(c.barrier())
        })?;
    }
    Ok(())
}

fn rma_requests(c: &Comm<DynProvider>) -> Result<(), String> {
    let (r, n) = (c.rank(), c.size());
    let t = (r + 1) % n;
    let mut mem = vec![0u32; 8];
    with_win(c, &mut mem, WinInfo::default(), false, |win| {
        let src: Vec<u32> = (0..8).map(|i| r * 10 + i).collect();
        let mut back = vec![0u32; 8];
        w(win.lock_epoch(t, LockKind::Exclusive, |e| {
            e.rput(&src, t, 0)?.wait()?;
            e.flush(t)?;
            e.rget(&mut back, t, 0)?.wait()
        }))?;
        ensure!(back == src, "rget read {back:?}");
        w(c.barrier())
    })
}

/// Every (operation, type) once from rank 1 to rank 0: accumulate into element 0,
/// fetch-and-op on element 1, a compare-and-swap that succeeds (element 2) and one that fails
/// (element 3); the results are checked against `weft_testing::oracle`, an implementation
/// independent of the library's.
fn atomics_oracle(c: &Comm<DynProvider>) -> Result<(), String> {
    fn per_type<T: Element + std::fmt::Debug>(
        c: &Comm<DynProvider>,
        alloc: bool,
        init: T,
        v: T,
        other: T,
    ) -> Result<(), String> {
        for op in Op::ALL {
            if !op.valid_for(T::TYPE) || op == Op::Cswap {
                continue;
            }
            let what = format!(
                "{} on {} ({})",
                op.name(),
                T::TYPE.name(),
                if alloc { "allocated" } else { "created" }
            );
            let mut mem = vec![init; 4];
            with_win(c, &mut mem, WinInfo::default(), alloc, |win| {
                let (mut old, mut cas_hit, mut cas_miss) = (v, v, v);
                w(win.fence_epoch(Assert::NONE, |e| {
                    if c.rank() == 1 {
                        e.accumulate(std::slice::from_ref(&v), 0, 0, op)?;
                        e.fetch_and_op(&v, &mut old, 0, 1, op)?;
                        e.compare_and_swap(&v, &init, &mut cas_hit, 0, 2)?;
                        e.compare_and_swap(&v, &other, &mut cas_miss, 0, 3)?;
                    }
                    Ok(())
                }))?;
                let want = weft_testing::oracle(op, init, v);
                if c.rank() == 0 {
                    let mut f = [init; 4];
                    w(win.read_local(0, &mut f))?;
                    ensure!(
                        f == [want, want, v, init],
                        "{what}: window holds {f:?}, expected {:?}",
                        [want, want, v, init]
                    );
                } else if c.rank() == 1 {
                    ensure!(
                        [old, cas_hit, cas_miss] == [init, init, init],
                        "{what}: fetched {:?}, expected the initial {init:?} three times",
                        [old, cas_hit, cas_miss]
                    );
                }
                Ok(())
            })?;
        }
        Ok(())
    }
    for alloc in [false, true] {
        per_type(c, alloc, -3i8, 5, 7)?;
        per_type(c, alloc, 3u8, 250, 7)?;
        per_type(c, alloc, -300i16, 7, 1)?;
        per_type(c, alloc, 3u16, 60_000, 1)?;
        per_type(c, alloc, -70_000i32, 9, 1)?;
        per_type(c, alloc, 3u32, 4_000_000_000, 1)?;
        per_type(c, alloc, -5i64, 1 << 40, 1)?;
        per_type(c, alloc, 3u64, u64::MAX - 1, 1)?;
        per_type(c, alloc, 1.5f32, -2.25, 0.0)?;
        per_type(c, alloc, -0.5f64, 3.75, 0.0)?;
    }
    Ok(())
}

/// Every rank hammers the same three elements of rank 0's window at once: fetch-and-add of 1
/// (element 0), a compare-and-swap increment loop (element 1) and accumulate-sum of rank + 1
/// (element 2). Exact results: each fetched value 0..n*K seen exactly once, element 1 = n*K,
/// element 2 = K*n(n+1)/2. With the window hint an HCA can serve natively (fetch-and-add and
/// compare-and-swap on i64 only) and with the default one.
fn atomics_contended(c: &Comm<DynProvider>) -> Result<(), String> {
    const K: i64 = 40;
    let (r, n) = (c.rank(), c.size() as i64);
    let hints = [
        None,
        Some(vec![
            (Op::Sum, weft::BasicType::I64),
            (Op::Cswap, weft::BasicType::I64),
        ]),
    ];
    for hint in hints {
        for alloc in [false, true] {
            let info = WinInfo {
                accumulate_ops: hint.clone(),
                sched: None,
                agg_max: None,
            };
            let mut mem = vec![0i64; 3];
            let mut fetched = vec![0i64; K as usize];
            with_win(c, &mut mem, info, alloc, |win| {
                let one = 1i64;
                let mine = [r as i64 + 1];
                w(win.lock_all_epoch(|e| {
                    for f in fetched.iter_mut() {
                        e.local(|l| l.fetch_and_op(&one, f, 0, 0, Op::Sum))?;
                        let mut guess = 0i64;
                        loop {
                            let mut seen = 0i64;
                            let next = guess + 1;
                            e.local(|l| l.compare_and_swap(&next, &guess, &mut seen, 0, 1))?;
                            if seen == guess {
                                break;
                            }
                            guess = seen;
                        }
                        e.accumulate(&mine, 0, 2, Op::Sum)?;
                    }
                    Ok(())
                }))?;
                w(c.barrier())?;
                if r == 0 {
                    let mut f = [0i64; 3];
                    w(win.read_local(0, &mut f))?;
                    let want = [n * K, n * K, K * n * (n + 1) / 2];
                    ensure!(
                        f == want,
                        "window holds {f:?}, expected {want:?} ({hint:?})"
                    );
                }
                Ok(())
            })?;
            let mut all = vec![0i64; (n * K) as usize];
            w(c.allgather(&fetched, &mut all))?;
            all.sort_unstable();
            let mut distinct = all.clone();
            distinct.dedup();
            ensure!(
                all.iter().copied().eq(0..n * K),
                "fetch-and-add handed out {} distinct values for {} increments ({hint:?}, \
                 alloc {alloc})",
                distinct.len(),
                n * K
            );
        }
    }
    Ok(())
}

fn outstanding(c: &Comm<DynProvider>) -> Result<(), String> {
    let (r, n) = (c.rank(), c.size());
    let k = 300;
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    let sends: Vec<Vec<u8>> = (0..k).map(|i| pattern(i * 53 % 5000, i as u8)).collect();
    let mut recvs: Vec<Vec<u8>> = (0..k).map(|i| vec![0u8; i * 53 % 5000]).collect();
    c.scope(|s| -> Result<(), String> {
        let mut reqs = vec![];
        for (i, b) in recvs.iter_mut().enumerate() {
            reqs.push(w(c.irecv(s, b, left, i as i32))?);
        }
        for (i, b) in sends.iter().enumerate() {
            reqs.push(w(c.isend(s, b, right, i as i32))?);
        }
        w(weft::waitall(reqs)).map(|_| ())
    })?;
    for (i, b) in recvs.iter().enumerate() {
        ensure!(*b == sends[i], "message {i} differs");
    }
    Ok(())
}

fn all_pairs(c: &Comm<DynProvider>) -> Result<(), String> {
    let (r, n) = (c.rank(), c.size() as usize);
    let size = 40_000;
    let out: Vec<Vec<u8>> = (0..n)
        .map(|d| pattern(size, (r as usize * 16 + d) as u8))
        .collect();
    let mut inb: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; size]).collect();
    c.scope(|s| -> Result<(), String> {
        let mut reqs = vec![];
        for (src, b) in inb.iter_mut().enumerate() {
            reqs.push(w(c.irecv(s, b, src as u32, 5))?);
        }
        for (d, b) in out.iter().enumerate() {
            reqs.push(w(c.isend(s, b, d as u32, 5))?);
        }
        w(weft::waitall(reqs)).map(|_| ())
    })?;
    for (src, b) in inb.iter().enumerate() {
        ensure!(
            *b == pattern(size, (src * 16 + r as usize) as u8),
            "payload from {src} differs"
        );
    }
    let send: Vec<u32> = (0..n as u32).map(|d| r * 1000 + d).collect();
    let mut recv = vec![0u32; n];
    w(c.alltoall(&send, &mut recv))?;
    ensure!(
        recv.iter()
            .enumerate()
            .all(|(s, x)| *x == s as u32 * 1000 + r),
        "alltoall {recv:?}"
    );
    Ok(())
}

/// Render outcomes as a pass/fail table per group.
pub fn table(provider: &str, outcomes: &[Outcome]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let mut groups: Vec<&str> = outcomes.iter().map(|o| o.group).collect();
    groups.dedup();
    writeln!(s, "conformance of provider '{provider}'").unwrap();
    writeln!(
        s,
        "{:<12} {:>6} {:>6}  failures",
        "group", "passed", "failed"
    )
    .unwrap();
    for g in groups {
        let of: Vec<&Outcome> = outcomes.iter().filter(|o| o.group == g).collect();
        let pass = of.iter().filter(|o| o.ok).count();
        let fails: Vec<String> = of
            .iter()
            .filter(|o| !o.ok)
            .map(|o| {
                if o.detail.is_empty() {
                    o.test.to_string()
                } else {
                    format!("{} ({})", o.test, o.detail)
                }
            })
            .collect();
        let line = format!(
            "{:<12} {:>6} {:>6}  {}",
            g,
            pass,
            of.len() - pass,
            fails.join("; ")
        );
        writeln!(s, "{}", line.trim_end()).unwrap();
    }
    let total = outcomes.len();
    let ok = outcomes.iter().filter(|o| o.ok).count();
    writeln!(
        s,
        "{}: {ok}/{total} checks passed",
        if ok == total { "PASS" } else { "FAIL" }
    )
    .unwrap();
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_lines_round_trip() {
        for (i, (g, t, _)) in CHECKS.iter().enumerate() {
            let o = Outcome {
                group: g,
                test: t,
                ok: i % 2 == 0,
                detail: if i % 3 == 0 {
                    "a\tmulti\nline reason".into()
                } else {
                    String::new()
                },
            };
            let back = Outcome::from_line(&o.to_line()).expect("parses");
            assert_eq!((back.group, back.test, back.ok), (o.group, o.test, o.ok));
            assert_eq!(back.detail, o.detail.replace(['\t', '\n'], " "));
        }
        assert!(Outcome::from_line("CHECK pass nosuch\tcheck\t").is_none());
        assert!(Outcome::from_line("CHECK maybe two-sided\twildcards\t").is_none());
        assert!(Outcome::from_line("hello").is_none());
    }
}
