//! Contract 2 through the C ABI 1.1, both directions in one process: the loopback provider with
//! every optional part switched on is exported with the SDK's tables (what `export_provider!`
//! builds for a library), taken back through the loader's checks (`from_entry`, what `dlopen`ed
//! libraries go through) and driven by the core. Descriptors, the fence flag, completion data,
//! zero-copy sends and lazy connections all cross the C tables. (One test function: the
//! provider's settings come from the environment, read once per process.)

use std::path::Path;
use std::time::Duration;
use weft::bootstrap::InProcessJob;
use weft::registry::Factory;
use weft::sdk::__abi::*;
use weft::{BasicType, Comm, EngineConfig, LockKind, Op, Provider, WinInfo, World};
use weft_loopback::Loopback;

static AM: WeftAmOps = weft::sdk::am_ops::<Loopback>();
static RMA: WeftRmaOps = weft::sdk::rma_ops::<Loopback>();
static ATOMICS: WeftAtomicOps = weft::sdk::atomic_ops::<Loopback>();
static CNTR: WeftCntrOps = weft::sdk::cntr_ops::<Loopback>();
static EXT: WeftExtOps = weft::sdk::ext_ops::<Loopback>();

struct Entry(WeftEntry);
// SAFETY: immutable static data, as for a library's entry.
unsafe impl Sync for Entry {}

static ENTRY: Entry = Entry(WeftEntry {
    abi_version: WEFT_ABI_VERSION,
    size: std::mem::size_of::<WeftEntry>() as u32,
    name: c"loopback".as_ptr(),
    version: c"0".as_ptr(),
    summary: c"loopback through the C tables".as_ptr(),
    priority: 0,
    reserved: 0,
    am: &AM,
    tagged: std::ptr::null(),
    rma: &RMA,
    atomics: &ATOMICS,
    cntr: &CNTR,
    ext: &EXT,
});

fn workload<P: Provider>(c: &Comm<P>) {
    let me = c.rank();
    let n = c.size();
    // Eager below and above the inject size (zero-copy), rendezvous by RMA read.
    for (i, len) in [8usize, 4000, 100_000, (1 << 20) + 5]
        .into_iter()
        .enumerate()
    {
        let data: Vec<u8> = (0..len).map(|k| (k * 7 + i) as u8).collect();
        if me == 0 {
            c.send(&data, 1, i as i32).unwrap();
        } else if me == 1 {
            let mut b = vec![0u8; len];
            c.recv(&mut b, 0, i as i32).unwrap();
            assert_eq!(b, data, "{len} bytes");
        }
    }
    c.barrier().unwrap();
    // RMA: fence (transmit-complete writes proven by fenced reads), PSCW (completion data),
    // HCA atomics (descriptors of origin, compare and result).
    let mut mem = vec![0i64; 4];
    let hint = WinInfo {
        accumulate_ops: Some(vec![(Op::Sum, BasicType::I64), (Op::Cswap, BasicType::I64)]),
        ..WinInfo::default()
    };
    c.win_create(&mut mem, hint, |w| {
        assert_eq!(w.native_paths(), (true, true, true));
        let right = (me + 1) % n;
        let left = (me + n - 1) % n;
        let v = [me as i64 + 100];
        w.fence_epoch(weft::Assert::NONE, |e| e.put(&v, right, 0))?;
        let mut m = [0i64; 4];
        w.read_local(0, &mut m)?;
        assert_eq!(m[0], left as i64 + 100);
        w.post(&[left])?;
        let v2 = [me as i64 + 200];
        w.start_epoch(&[right], |e| e.put(&v2, right, 1))?;
        w.wait()?;
        w.read_local(0, &mut m)?;
        assert_eq!(m[1], left as i64 + 200);
        let one = 1i64;
        for _ in 0..10 {
            let mut old = 0i64;
            w.lock_epoch(0, LockKind::Shared, |e| {
                e.fetch_and_op(&one, &mut old, 0, 2, Op::Sum)
            })?;
        }
        c.barrier()?;
        if me == 0 {
            w.read_local(0, &mut m)?;
            assert_eq!(m[2], 10 * n as i64);
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn contract_2_crosses_the_c_tables() {
    for (k, v) in [
        ("WEFT_LOOPBACK_RMA", "1"),
        ("WEFT_LOOPBACK_ZCOPY", "1"),
        ("WEFT_LOOPBACK_MR_LOCAL", "1"),
        ("WEFT_LOOPBACK_COMPLETION", "transmit"),
        ("WEFT_LOOPBACK_LAZY", "1"),
        ("WEFT_LOOPBACK_ATOMICS", "hca"),
    ] {
        std::env::set_var(k, v);
    }
    // SAFETY: static tables of this test binary.
    let lp = unsafe { weft::loader::from_entry(Path::new("(in memory)"), "loopback", &ENTRY.0) }
        .expect("the SDK's tables pass the loader's checks");
    let caps = lp.caps().unwrap();
    assert!(caps.mr_local && caps.am_isend && caps.lazy_connect && caps.per_peer);
    let r = caps.rma.expect("rma");
    assert!(r.fence && r.cq_data_size == 4);
    assert_eq!(r.completion, weft::provider::CompletionLevel::Transmit);
    assert_eq!(caps.atomic_max_count, 1);

    let n = 3;
    let job = InProcessJob::new(n, Duration::from_secs(60));
    let lp = &lp;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let job = job.clone();
                s.spawn(move || {
                    let mut boot = job.rank(r);
                    let p = lp.open(&mut boot).unwrap();
                    let cfg = EngineConfig {
                        timeout: Some(Duration::from_secs(60)),
                        ..EngineConfig::default()
                    };
                    let w = World::from_parts(p, Box::new(boot), cfg).unwrap();
                    workload(w.comm());
                    let conns = w.comm().connections();
                    let cache = w.comm().registration_cache();
                    w.finalize().unwrap();
                    (conns, cache)
                })
            })
            .collect();
        for h in hs {
            let ((asked, _), cache) = h.join().expect("rank");
            // Connections were asked for through the table (each peer once, oneself included
            // when a window targets it).
            assert!((2..=3).contains(&asked), "{asked}");
            assert!(cache.misses > 0, "descriptors were made: {cache:?}");
        }
    });
}
