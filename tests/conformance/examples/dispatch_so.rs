//! Instruction-count probe of the dynamic path (for valgrind/callgrind): `dispatch_so MODE N DIR`
//! runs N 8-byte self-sends (irecv + isend + wait both) on the `rdgram` example provider,
//! linked statically (`static`), behind `Box<dyn Provider>` (`dynamic`), or loaded from
//! `DIR/libweft-rdgram.so` through the C ABI (`loaded`). The per-message cost is the difference
//! of two runs with different N, divided by the difference of N (docs/history/benchmarks-notebook.md).
//!
//! `dispatch_so interleaved N DIR [REPS]` opens all three in one process and times them in
//! interleaved repetitions (static, dynamic, loaded, static, ...), printing the median wall time
//! per message of each and the ratios to static.

use weft::bootstrap::Singleton;
use weft::provider::StaticProvider;
use weft::{Comm, DynProvider, EngineConfig, Provider, World};
use weft_rdgram::Dgram;

fn roundtrips<P: Provider>(c: &Comm<P>, n: usize) {
    let out = [42u64];
    let mut inb = [0u64];
    for _ in 0..n {
        c.scope(|s| {
            let r = c.irecv(s, &mut inb, 0u32, 1).unwrap();
            c.isend(s, &out, 0, 1).unwrap().wait().unwrap();
            r.wait().unwrap();
        });
    }
}

fn main() {
    let mut a = std::env::args().skip(1);
    let mode = a.next().unwrap_or_else(|| "static".into());
    let n: usize = a.next().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let mut b = Singleton::new();
    match mode.as_str() {
        "static" => {
            let p = Dgram::open(&mut b).unwrap();
            let w = World::from_parts(p, Box::new(b), EngineConfig::default()).unwrap();
            roundtrips(w.comm(), n);
        }
        "dynamic" => {
            let p: DynProvider = Box::new(Dgram::open(&mut b).unwrap());
            let w = World::from_parts(p, Box::new(b), EngineConfig::default()).unwrap();
            roundtrips(w.comm(), n);
        }
        "loaded" => {
            let dir = a
                .next()
                .expect("loaded needs the directory of libweft-rdgram.so");
            std::env::set_var("WEFT_PROVIDER_PATH", dir);
            let (all, failures) = weft::registry::providers();
            assert!(failures.is_empty(), "{failures:?}");
            let f = all.iter().find(|f| f.name() == "rdgram").expect("rdgram");
            let p = f.open(&mut b).unwrap();
            let w = World::from_parts(p, Box::new(b), EngineConfig::default()).unwrap();
            roundtrips(w.comm(), n);
        }
        "interleaved" => {
            let dir = a
                .next()
                .expect("interleaved needs the directory of libweft-rdgram.so");
            let reps: usize = a.next().and_then(|v| v.parse().ok()).unwrap_or(9);
            std::env::set_var("WEFT_PROVIDER_PATH", dir);
            let ws = World::from_parts(
                Dgram::open(&mut b).unwrap(),
                Box::new(b),
                EngineConfig::default(),
            )
            .unwrap();
            let mut b = Singleton::new();
            let p: DynProvider = Box::new(Dgram::open(&mut b).unwrap());
            let wd = World::from_parts(p, Box::new(b), EngineConfig::default()).unwrap();
            let (all, failures) = weft::registry::providers();
            assert!(failures.is_empty(), "{failures:?}");
            let f = all.iter().find(|f| f.name() == "rdgram").expect("rdgram");
            let mut b = Singleton::new();
            let wl = World::from_parts(
                f.open(&mut b).unwrap(),
                Box::new(b),
                EngineConfig::default(),
            )
            .unwrap();
            let mut t = [vec![], vec![], vec![]];
            let time = |f: &dyn Fn()| {
                let t0 = std::time::Instant::now();
                f();
                t0.elapsed().as_secs_f64() * 1e9 / n as f64
            };
            for _ in 0..reps {
                t[0].push(time(&|| roundtrips(ws.comm(), n)));
                t[1].push(time(&|| roundtrips(wd.comm(), n)));
                t[2].push(time(&|| roundtrips(wl.comm(), n)));
            }
            let med: Vec<f64> = t
                .iter_mut()
                .map(|v| {
                    v.sort_by(|a, b| a.total_cmp(b));
                    v[v.len() / 2]
                })
                .collect();
            println!("8-byte self-send, median of {reps} interleaved repetitions of {n} messages");
            for (name, m) in ["static", "dynamic", "loaded"].iter().zip(&med) {
                println!("{name:<8} {m:8.1} ns/msg  x{:.3}", m / med[0]);
            }
        }
        other => panic!("unknown mode {other}"),
    }
}
