//! The rank side of `weft bench`: each job runs one test over a list of sizes and rank 0 prints
//! one `RESULT <size> <value>` line per size on stdout.

use super::tests::Test;
use std::time::Instant;
use weft::{Comm, DynProvider, Result, SharedBuf};

/// What one job measures.
#[derive(Debug, Clone)]
pub struct RankArgs {
    pub test: Test,
    pub sizes: Vec<usize>,
    pub iters: usize,
    pub warmup: usize,
    pub window: usize,
    /// Latency: send from the buffer received into (NetPIPE's convention).
    pub one_buffer: bool,
    /// bw, bibw, mr: a receive buffer per message of the window, instead of one for all.
    pub distinct_buffers: bool,
    /// Latency: buffers in transparent huge pages, as ucx_perftest's are.
    pub thp: bool,
}

/// Iterations for `size`: the requested count, fewer for large messages so each point moves at
/// most about `budget` bytes, but never below `floor`.
pub fn scaled(iters: usize, size: usize, budget: usize, floor: usize) -> usize {
    let cap = budget / size.max(1);
    iters.min(cap).max(floor)
}

/// Window actually used for `size`: the requested one, reduced so that the distinct buffers of
/// one window stay under 256 MiB.
pub fn effective_window(window: usize, size: usize) -> usize {
    window.min((256usize << 20) / size.max(1)).max(1)
}

/// Window of a streaming test: the requested one when the whole window receives into one
/// buffer, else [`effective_window`].
fn stream_window(window: usize, size: usize, distinct: bool) -> usize {
    if distinct {
        effective_window(window, size)
    } else {
        window.max(1)
    }
}

fn pattern(size: usize) -> Vec<u8> {
    (0..size).map(|i| i as u8).collect()
}

/// Bytes of a page, for [`PageBuf`].
const PAGE: usize = 4096;

/// A buffer that starts on a page boundary, as OSU's and ucx_perftest's do: a kernel copy
/// (CMA) or a registration then touches `len / 4096` pages rather than one more, whatever
/// the allocator returned.
struct PageBuf {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

/// Bytes of a transparent huge page (x86-64), for [`PageBuf::new`] with `thp`.
const HUGE: usize = 2 << 20;

impl PageBuf {
    /// A copy of `bytes` on a page boundary; with `thp` on a 2 MiB boundary in memory
    /// advised for transparent huge pages, as UCX's `thp` allocation method gives
    /// ucx_perftest's buffers (a kernel copy then walks a 2 MiB page where it walked 512 small
    /// ones). Where the kernel declines, the memory stays in small pages.
    fn new(bytes: &[u8], thp: bool) -> PageBuf {
        let len = bytes.len();
        let (align, span) = if thp {
            (HUGE, len.next_multiple_of(HUGE).max(HUGE))
        } else {
            (PAGE, len)
        };
        // Zeroed by calloc: from 128 KiB up fresh mappings, untouched until written below.
        let mut v = vec![0u8; span + align];
        let off = v.as_ptr().align_offset(align).min(align);
        if thp {
            // SAFETY: [off, off + span) lies inside `v` (its length is span + align and
            // off < align), starts on a page boundary, and madvise changes no byte of it.
            unsafe { libc::madvise(v.as_mut_ptr().add(off).cast(), span, libc::MADV_HUGEPAGE) };
        }
        v[off..off + len].copy_from_slice(bytes);
        PageBuf { v, off, len }
    }

    fn zeroed(len: usize, thp: bool) -> PageBuf {
        PageBuf::new(&vec![0u8; len], thp)
    }

    fn get(&self) -> &[u8] {
        &self.v[self.off..self.off + self.len]
    }

    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.len]
    }
}

/// Ping-pong between ranks 0 and 1: from a send buffer into a separate receive buffer (OSU's and
/// ucx_perftest's convention), or with `one_buffer` from and into one buffer per rank (NetPIPE's),
/// which halves what the caches must hold; returns the one-way time in µs. Buffers start on a
/// page boundary, as those tools' do.
fn latency(
    c: &Comm<DynProvider>,
    size: usize,
    iters: usize,
    warmup: usize,
    one_buffer: bool,
    thp: bool,
) -> Result<f64> {
    let r = c.rank();
    let data = PageBuf::new(&pattern(size), thp);
    let mut buf = if one_buffer {
        PageBuf::new(data.get(), thp)
    } else {
        PageBuf::zeroed(size, thp)
    };
    let mut t0 = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            c.barrier()?;
            t0 = Instant::now();
        }
        // NetPIPE's convention sends what was just received, from the same buffer.
        match r {
            0 => {
                c.send(if one_buffer { buf.get() } else { data.get() }, 1, 1)?;
                c.recv(buf.get_mut(), 1, 1)?;
            }
            1 => {
                c.recv(buf.get_mut(), 0, 1)?;
                c.send(if one_buffer { buf.get() } else { data.get() }, 0, 1)?;
            }
            _ => {}
        }
    }
    let dt = t0.elapsed().as_secs_f64();
    Ok(dt * 1e6 / (2.0 * iters as f64))
}

/// Windowed streaming from `from` to `to`; both directions at once when `both`.
/// Every receive of a window goes into one buffer (OSU's and ucx_perftest's convention), or with
/// `distinct` each into its own, as an application's would.
/// Returns bytes moved per second (all directions) and messages per second.
fn stream(
    c: &Comm<DynProvider>,
    size: usize,
    iters: usize,
    warmup: usize,
    window: usize,
    both: bool,
    distinct: bool,
) -> Result<(f64, f64)> {
    let r = c.rank();
    let w = stream_window(window, size, distinct);
    let data = pattern(size);
    let n_bufs = if distinct { w } else { 0 };
    let mut bufs: Vec<Vec<u8>> = (0..n_bufs).map(|_| vec![0u8; size]).collect();
    let shared = SharedBuf::new(if distinct { 0 } else { size });
    let mut ack = [0u8; 4];
    let mut t0 = Instant::now();
    if r > 1 {
        c.barrier()?;
        return Ok((0.0, 0.0));
    }
    let peer = 1 - r;
    for i in 0..warmup + iters {
        if i == warmup {
            c.barrier()?;
            t0 = Instant::now();
        }
        let sending = r == 0 || both;
        let receiving = r == 1 || both;
        c.scope(|s| -> Result<()> {
            let mut reqs = Vec::with_capacity(2 * w);
            if receiving && distinct {
                for b in bufs.iter_mut() {
                    reqs.push(c.irecv(s, b, peer, 2)?);
                }
            } else if receiving {
                for _ in 0..w {
                    reqs.push(c.irecv_shared(s, &shared, peer, 2)?);
                }
            }
            if sending {
                for _ in 0..w {
                    reqs.push(c.isend(s, &data, peer, 2)?);
                }
            }
            weft::waitall(reqs)?;
            Ok(())
        })?;
        // The receiver acknowledges each window (OSU style).
        if r == 1 {
            c.send(&ack, 0, 3)?;
        } else {
            c.recv(&mut ack, 1, 3)?;
        }
    }
    let dt = t0.elapsed().as_secs_f64();
    let msgs = (iters * w) as f64 * if both { 2.0 } else { 1.0 };
    Ok((msgs * size as f64 / dt, msgs / dt))
}

fn alltoall(c: &Comm<DynProvider>, size: usize, iters: usize, warmup: usize) -> Result<f64> {
    let n = c.size() as usize;
    let send = vec![1u8; size * n];
    let mut recv = vec![0u8; size * n];
    let mut t0 = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            c.barrier()?;
            t0 = Instant::now();
        }
        c.alltoall(&send, &mut recv)?;
    }
    let mine = [t0.elapsed().as_secs_f64() * 1e6 / iters as f64];
    let mut worst = [0f64];
    c.allreduce(&mine, &mut worst, weft::Op::Max)?;
    Ok(worst[0])
}

/// The peers of `r` in a job of `n` for the pattern tests: `halo` the ranks at ring distance
/// 1 and 2; `sparse` up to 16 ranks at distances spread from 1 to (n-1)/2 both ways. The
/// relation is symmetric (r is a peer of each of its peers), so every send has its receive.
pub fn pattern_peers(r: u32, n: u32, sparse: bool) -> Vec<u32> {
    let dists: Vec<u32> = if sparse {
        let half = ((n - 1) / 2).max(1);
        let k = (n - 1).min(16).div_ceil(2).max(1);
        (0..k)
            .map(|j| 1 + if k > 1 { j * (half - 1) / (k - 1) } else { 0 })
            .collect()
    } else {
        vec![1, 2]
    };
    let mut v: Vec<u32> = dists
        .iter()
        .flat_map(|&d| [(r + d) % n, (r + n - d % n) % n])
        .filter(|&p| p != r)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// One step of a pattern: with each peer of `near` exchange `size` bytes, with each peer of
/// `far` exchange `far_size` bytes, all at once.
fn pattern_step(
    c: &Comm<DynProvider>,
    near: &[u32],
    size: usize,
    far: &[u32],
    far_size: usize,
    out: &[u8],
    bufs: &mut [Vec<u8>],
) -> Result<()> {
    c.scope(|s| -> Result<()> {
        let mut reqs = Vec::with_capacity(2 * (near.len() + far.len()));
        let mut it = bufs.iter_mut();
        for (&p, n) in near
            .iter()
            .map(|p| (p, size))
            .chain(far.iter().map(|p| (p, far_size)))
        {
            let b = it.next().expect("one buffer per peer");
            reqs.push(c.irecv(s, &mut b[..n], p, 5)?);
        }
        for (&p, n) in near
            .iter()
            .map(|p| (p, size))
            .chain(far.iter().map(|p| (p, far_size)))
        {
            reqs.push(c.isend(s, &out[..n], p, 5)?);
        }
        weft::waitall(reqs)?;
        Ok(())
    })
}

/// µs per step of `test` (halo, sparse, mixed) with `size` bytes, slowest rank.
fn pattern_test(
    c: &Comm<DynProvider>,
    test: Test,
    size: usize,
    iters: usize,
    warmup: usize,
) -> Result<f64> {
    let (r, n) = (c.rank(), c.size());
    let (near, far, far_size) = match test {
        Test::Halo => (pattern_peers(r, n, false), vec![], 0),
        Test::Sparse => (pattern_peers(r, n, true), vec![], 0),
        _ => {
            let near = pattern_peers(r, n, false);
            let far: Vec<u32> = pattern_peers(r, n, true)
                .into_iter()
                .filter(|p| !near.contains(p))
                .collect();
            (near, far, 64)
        }
    };
    let out = vec![7u8; size.max(far_size)];
    let mut bufs: Vec<Vec<u8>> = (0..near.len() + far.len())
        .map(|_| vec![0u8; size.max(far_size)])
        .collect();
    let mut t0 = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            c.barrier()?;
            t0 = Instant::now();
        }
        pattern_step(c, &near, size, &far, far_size, &out, &mut bufs)?;
    }
    let mine = [t0.elapsed().as_secs_f64() * 1e6 / iters as f64];
    let mut worst = [0f64];
    c.allreduce(&mine, &mut worst, weft::Op::Max)?;
    Ok(worst[0])
}

/// Memory for communication after `iters` alltoalls of `size` bytes per pair (every rank has
/// talked to every other): the sum of the provider's `mem_*` counters, in KiB, of the rank that
/// holds the most. A provider without them is an error naming the test, not a zero.
fn memory(c: &Comm<DynProvider>, size: usize, iters: usize) -> Result<f64> {
    alltoall(c, size, iters.max(1), 1)?;
    let counters = c.provider_counters();
    let mem: Vec<u64> = counters
        .iter()
        .filter(|(k, _)| k.starts_with("mem_"))
        .map(|(_, v)| *v)
        .collect();
    let mine = [mem.iter().sum::<u64>() as f64 / 1024.0];
    let mut most = [0f64];
    c.allreduce(&mine, &mut most, weft::Op::Max)?;
    if mem.is_empty() {
        return Err(weft::Error::invalid(
            "mem: this provider reports no memory counters (mem_*); verbs-rc and verbs-ud do",
        ));
    }
    Ok(most[0])
}

/// Issue one access epoch's operations for an RMA test.
fn rma_ops<'e>(
    e: &weft::Epoch<'e, '_, DynProvider>,
    test: Test,
    peer: u32,
    bytes: usize,
    src: &'e [u64],
    dst: &'e mut [u64],
) -> Result<()> {
    let sb: &'e [u8] = &bytemuck::cast_slice(src)[..bytes];
    let db: &'e mut [u8] = &mut bytemuck::cast_slice_mut(dst)[..bytes];
    match test {
        Test::PutLat => e.put(sb, peer, 0),
        Test::GetLat => e.get(db, peer, 0),
        Test::AccLat => e.accumulate(src, peer, 0, weft::Op::Sum),
        _ => {
            // The get reads the second half of the window (displacements count u64s).
            e.put(sb, peer, 0)?;
            e.get(db, peer, bytes.div_ceil(8))
        }
    }
}

/// RMA ping-pong over post-start-complete-wait: an access epoch with the test's operations,
/// then an exposure epoch; returns half the iteration time in µs.
fn rma_pingpong(
    c: &Comm<DynProvider>,
    size: usize,
    iters: usize,
    warmup: usize,
    test: Test,
) -> Result<f64> {
    let r = c.rank();
    let elems = size.div_ceil(8).max(1);
    let mut mem = vec![0u64; 2 * elems];
    c.win_create(&mut mem, weft::WinInfo::default(), |win| {
        let src = vec![1u64; elems];
        let mut dst = vec![0u64; elems];
        let bytes = size.max(1).min(elems * 8);
        let mut t0 = Instant::now();
        if r <= 1 {
            let peer = 1 - r;
            for i in 0..warmup + iters {
                if i == warmup {
                    t0 = Instant::now();
                }
                if r == 0 {
                    win.start_epoch(&[peer], |e| rma_ops(e, test, peer, bytes, &src, &mut dst))?;
                    win.post(&[peer])?;
                    win.wait()?;
                } else {
                    win.post(&[peer])?;
                    win.wait()?;
                    win.start_epoch(&[peer], |e| rma_ops(e, test, peer, bytes, &src, &mut dst))?;
                }
            }
        }
        let dt = t0.elapsed().as_secs_f64();
        Ok(dt * 1e6 / (2.0 * iters as f64))
    })
}

/// RMA ping-pong with `ucx_perftest`'s definition (`ucp_put_lat`): on a window the provider
/// allocates (shared memory where it can), each of ranks 0 and 1 holds a passive-target epoch
/// on the other for the whole run; rank 0 puts `size` bytes whose last byte is the iteration's
/// mark and flushes; rank 1 polls its own memory until that byte arrives, then answers the
/// same way. Half the round trip, µs. Every wait is bounded.
fn put_poll_pingpong(
    c: &Comm<DynProvider>,
    size: usize,
    iters: usize,
    warmup: usize,
) -> Result<f64> {
    let r = c.rank();
    let bytes = size.max(1);
    let win = c.win_allocate::<u8>(bytes, weft::WinInfo::default())?;
    let mut t0 = Instant::now();
    let out = if r <= 1 {
        let peer = 1 - r;
        let mut buf = vec![0u8; bytes];
        win.lock_epoch(peer, weft::LockKind::Shared, |e| {
            let wait = |mark: u8| -> Result<()> {
                let deadline = Instant::now() + std::time::Duration::from_secs(60);
                let mut last = [0u8];
                loop {
                    win.sync_read_local(bytes - 1, &mut last)?;
                    if last[0] == mark {
                        return Ok(());
                    }
                    if Instant::now() > deadline {
                        return Err(weft::Error::invalid(format!(
                            "put_poll_lat: rank {r}: the peer's put {mark} did not arrive in 60 s"
                        )));
                    }
                }
            };
            for i in 0..warmup + iters {
                if i == warmup {
                    t0 = Instant::now();
                }
                // Marks 1..=255 in turn: never the window's initial zero, never the last one.
                let mark = (i % 255) as u8 + 1;
                if r == 1 {
                    wait(mark)?;
                }
                buf[bytes - 1] = mark;
                e.local(|l| l.put(&buf[..], peer, 0))?;
                e.flush(peer)?;
                if r == 0 {
                    wait(mark)?;
                }
            }
            Ok(())
        })
    } else {
        Ok(())
    };
    let dt = t0.elapsed().as_secs_f64();
    c.barrier()?;
    let freed = win.free();
    out?;
    freed?;
    Ok(dt * 1e6 / (2.0 * iters as f64))
}

/// RMA throughput in fence epochs: rank 0 issues `w` operations (puts, gets, or 16 of each)
/// per epoch to rank 1; returns MB/s of data moved.
fn rma_stream(
    c: &Comm<DynProvider>,
    size: usize,
    iters: usize,
    warmup: usize,
    window: usize,
    test: Test,
) -> Result<f64> {
    let r = c.rank();
    let (nput, nget) = match test {
        Test::PutBw => (effective_window(window, size), 0),
        Test::GetBw => (0, effective_window(window, size)),
        _ => (16, 16),
    };
    let slots = nput + nget;
    let mut mem = vec![0u8; slots * size.max(1)];
    c.win_create(&mut mem, weft::WinInfo::default(), |win| {
        let src = vec![7u8; size.max(1)];
        let mut dst: Vec<Vec<u8>> = (0..nget).map(|_| vec![0u8; size.max(1)]).collect();
        let mut t0 = Instant::now();
        for i in 0..warmup + iters {
            if i == warmup {
                c.barrier()?;
                t0 = Instant::now();
            }
            win.fence_epoch(weft::Assert::NONE, |e| {
                if r == 0 {
                    for k in 0..nput {
                        e.put(&src[..size], 1, k * size)?;
                    }
                    for (k, d) in dst.iter_mut().enumerate() {
                        e.get(&mut d[..size], 1, (nput + k) * size)?;
                    }
                }
                Ok(())
            })?;
        }
        let dt = t0.elapsed().as_secs_f64();
        Ok((slots * size * iters) as f64 / dt / 1e6)
    })
}

/// Run one job's measurements; rank 0 prints the results.
pub fn run(a: &RankArgs) -> Result<()> {
    let world = weft::init()?;
    let c = world.comm();
    if c.size() < a.test.min_ranks() {
        return Err(weft::Error::invalid(format!(
            "{} needs at least {} ranks",
            a.test.name(),
            a.test.min_ranks()
        )));
    }
    if a.test.is_verbs() {
        let r = super::verbs::measure(c, a.test, &a.sizes, a.iters, a.warmup, a.window)?;
        if c.rank() == 0 {
            for (size, v) in r {
                println!("RESULT {size} {v}");
            }
        }
        return world.finalize();
    }
    for &size in &a.sizes {
        let v = match a.test {
            Test::Latency => {
                let it = scaled(a.iters, size, 512 << 20, 20);
                latency(
                    c,
                    size,
                    it,
                    scaled(a.warmup, size, 64 << 20, 2),
                    a.one_buffer,
                    a.thp,
                )?
            }
            Test::Bw | Test::Bibw | Test::Mr => {
                let w = stream_window(a.window, size, a.distinct_buffers);
                let it = scaled(a.iters, size * w, 2 << 30, 3);
                let wu = scaled(a.warmup, size * w, 256 << 20, 1);
                let both = a.test == Test::Bibw;
                let (bps, mps) = stream(c, size, it, wu, a.window, both, a.distinct_buffers)?;
                if a.test == Test::Mr {
                    mps
                } else {
                    bps / 1e6
                }
            }
            Test::Alltoall => {
                let it = scaled(a.iters, size * c.size() as usize, 512 << 20, 10);
                alltoall(c, size, it, scaled(a.warmup, size, 64 << 20, 2))?
            }
            Test::Halo | Test::Sparse | Test::Mixed => {
                let it = scaled(a.iters, size * 4, 256 << 20, 10);
                pattern_test(c, a.test, size, it, scaled(a.warmup, size, 64 << 20, 2))?
            }
            Test::Mem => memory(c, size, a.iters)?,
            Test::PutLat | Test::GetLat | Test::AccLat | Test::EpochPingpong => {
                let it = scaled(a.iters, size, 256 << 20, 20);
                rma_pingpong(c, size, it, scaled(a.warmup, size, 32 << 20, 2), a.test)?
            }
            Test::PutPollLat => {
                let it = scaled(a.iters, size, 256 << 20, 20);
                put_poll_pingpong(c, size, it, scaled(a.warmup, size, 32 << 20, 2))?
            }
            Test::VerbsSendLat
            | Test::VerbsWriteLat
            | Test::VerbsWriteLatDm
            | Test::VerbsReadLat
            | Test::VerbsAtomicLat
            | Test::VerbsWriteBw
            | Test::VerbsSendBw
            | Test::CmaWriteLat
            | Test::CmaWriteBw => {
                return Err(weft::Error::invalid("raw verbs tests are measured above"))
            }
            Test::PutBw | Test::GetBw | Test::EpochMix => {
                let per = size * effective_window(a.window, size).max(32);
                let it = scaled(a.iters, per, 2 << 30, 3);
                rma_stream(
                    c,
                    size,
                    it,
                    scaled(a.warmup, per, 256 << 20, 1),
                    a.window,
                    a.test,
                )?
            }
        };
        if c.rank() == 0 {
            println!("RESULT {size} {v}");
        }
    }
    counters(c)?;
    world.finalize()
}

/// The provider's counters summed over the ranks, printed by rank 0 as one `COUNTERS` line
/// (`name=value ...`) for the report's JSON (e.g. the hybrid provider's messages per channel).
/// Ranks that disagree on the list (a composition) print nothing.
fn counters(c: &Comm<DynProvider>) -> Result<()> {
    let mine = c.provider_counters();
    let n = [mine.len() as u64];
    let (mut lo, mut hi) = ([0u64], [0u64]);
    c.allreduce(&n, &mut lo, weft::Op::Min)?;
    c.allreduce(&n, &mut hi, weft::Op::Max)?;
    if lo != hi || mine.is_empty() {
        return Ok(());
    }
    let vals: Vec<u64> = mine.iter().map(|(_, v)| *v).collect();
    let mut sum = vec![0u64; vals.len()];
    c.allreduce(&vals, &mut sum, weft::Op::Sum)?;
    if c.rank() == 0 {
        let kv: Vec<String> = mine
            .iter()
            .zip(&sum)
            .map(|((k, _), v)| format!("{k}={v}"))
            .collect();
        println!("COUNTERS {}", kv.join(" "));
    }
    Ok(())
}

#[cfg(test)]
mod page_buf {
    use super::{PageBuf, HUGE, PAGE};

    #[test]
    fn buffers_start_on_a_page_and_hold_their_bytes() {
        for (thp, align) in [(false, PAGE), (true, HUGE)] {
            for len in [0usize, 1, 8, 4095, 4096, 65536 + 3, HUGE + 5] {
                let bytes: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
                let mut b = PageBuf::new(&bytes, thp);
                assert_eq!(b.get().as_ptr() as usize % align, 0, "{len}");
                assert_eq!(b.get(), &bytes[..]);
                assert_eq!(b.get_mut().len(), len);
                assert!(PageBuf::zeroed(len, thp).get().iter().all(|&x| x == 0));
            }
        }
    }
}

#[cfg(test)]
mod peers {
    use super::pattern_peers;

    #[test]
    fn pattern_peers_are_symmetric_and_bounded() {
        for n in [3u32, 4, 5, 8, 17, 64, 256] {
            for sparse in [false, true] {
                for r in 0..n {
                    let p = pattern_peers(r, n, sparse);
                    assert!(!p.contains(&r));
                    assert!(p.len() <= if sparse { 16 } else { 4 }, "{n} {r} {p:?}");
                    assert!(!p.is_empty());
                    for &q in &p {
                        assert!(pattern_peers(q, n, sparse).contains(&r), "{n} {r} {q}");
                    }
                }
            }
        }
        assert_eq!(pattern_peers(0, 64, true).len(), 16);
        assert_eq!(pattern_peers(5, 8, false), vec![3, 4, 6, 7]);
    }
}
