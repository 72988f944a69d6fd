//! What the dynamic path costs: the same provider (the `rdgram` example) three ways, one rank
//! sending 8 bytes to itself (isend + irecv + wait both), so that the per-message cost of the
//! dispatch is not hidden behind a system call:
//!
//! - `static`: `World<Dgram>`, the provider type known at compile time (inlined);
//! - `dynamic`: `World<Box<dyn Provider>>` over the same type linked in (one virtual call per
//!   provider operation);
//! - `loaded`: `libweft-rdgram.so` from `WEFT_PROVIDER_PATH` through the C ABI (a virtual call
//!   into the loader's wrapper, then an `extern "C"` call through the table into the library).

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::path::{Path, PathBuf};
use weft::bootstrap::Singleton;
use weft::provider::StaticProvider;
use weft::{Comm, DynProvider, EngineConfig, Provider, World};
use weft_rdgram::Dgram;

fn roundtrip<P: Provider>(c: &Comm<P>, out: &[u64; 1], inb: &mut [u64; 1]) {
    c.scope(|s| {
        let r = c.irecv(s, inb, 0u32, 1).unwrap();
        let w = c.isend(s, out, 0, 1).unwrap();
        w.wait().unwrap();
        r.wait().unwrap();
    });
}

/// `libweft_rdgram.so` of the release profile, installed as `libweft-rdgram.so` in a directory
/// under target/.
fn install() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let prof = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
    let st = std::process::Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--release", "-p", "weft-example-rdgram"])
        .status()
        .unwrap();
    assert!(st.success(), "building the rdgram example");
    let dir = prof.join("bench-providers");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        prof.join("libweft_rdgram.so"),
        dir.join("libweft-rdgram.so"),
    )
    .unwrap();
    dir
}

fn dispatch(c: &mut Criterion) {
    std::env::set_var("WEFT_PROVIDER_PATH", install());
    let mut b = Singleton::new();
    let ws: World<Dgram> = World::from_parts(
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
    let f = all
        .iter()
        .find(|f| f.name() == "rdgram")
        .expect("rdgram loaded");
    let mut b = Singleton::new();
    let p = f.open(&mut b).unwrap();
    let wl = World::from_parts(p, Box::new(b), EngineConfig::default()).unwrap();

    let out = [42u64];
    let mut inb = [0u64];
    let mut g = c.benchmark_group("rdgram_isend_irecv_wait_8B_self");
    g.bench_function("static", |bn| {
        bn.iter(|| roundtrip(ws.comm(), black_box(&out), &mut inb))
    });
    g.bench_function("dynamic", |bn| {
        bn.iter(|| roundtrip(wd.comm(), black_box(&out), &mut inb))
    });
    g.bench_function("loaded", |bn| {
        bn.iter(|| roundtrip(wl.comm(), black_box(&out), &mut inb))
    });
    g.finish();
}

criterion_group!(benches, dispatch);
criterion_main!(benches);
