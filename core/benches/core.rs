//! Core micro-benchmarks: the cost of the core per 8-byte isend+irecv+wait on the loopback
//! provider through the static (`World<Loopback>`) and the dynamic (`World<Box<dyn Provider>>`)
//! path; the matching engine with few and many outstanding entries; datatype commit.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use std::time::Duration;
use weft::bootstrap::InProcessJob;
use weft::matching::Matcher;
use weft::{Comm, Datatype, DynProvider, EngineConfig, Provider, World};
use weft_loopback::{Loopback, LoopbackConfig};

fn world_static() -> World<Loopback> {
    let job = InProcessJob::new(1, Duration::from_secs(10));
    let mut b = job.rank(0);
    let cfg = LoopbackConfig {
        eager: 16 << 10,
        depth: 4096,
        rma: false,
        ..Default::default()
    };
    let p = Loopback::open_with(&mut b, &cfg).unwrap();
    World::from_parts(p, Box::new(b), EngineConfig::default()).unwrap()
}

fn world_dynamic() -> World<DynProvider> {
    let job = InProcessJob::new(1, Duration::from_secs(10));
    let mut b = job.rank(0);
    let cfg = LoopbackConfig {
        eager: 16 << 10,
        depth: 4096,
        rma: false,
        ..Default::default()
    };
    let p: DynProvider = Box::new(Loopback::open_with(&mut b, &cfg).unwrap());
    World::from_parts(p, Box::new(b), EngineConfig::default()).unwrap()
}

/// One 8-byte message to oneself: irecv, isend, wait both.
fn roundtrip<P: Provider>(c: &Comm<P>, out: &[u64; 1], inb: &mut [u64; 1]) {
    c.scope(|s| {
        let r = c.irecv(s, inb, 0u32, 1).unwrap();
        let w = c.isend(s, out, 0, 1).unwrap();
        w.wait().unwrap();
        r.wait().unwrap();
    });
}

fn dispatch(c: &mut Criterion) {
    let mut g = c.benchmark_group("isend_irecv_wait_8B");
    let ws = world_static();
    let wd = world_dynamic();
    let out = [42u64];
    let mut inb = [0u64];
    g.bench_function("static", |b| {
        b.iter(|| roundtrip(ws.comm(), black_box(&out), &mut inb))
    });
    g.bench_function("dynamic", |b| {
        b.iter(|| roundtrip(wd.comm(), black_box(&out), &mut inb))
    });
    g.finish();
}

fn matching(c: &mut Criterion) {
    let mut g = c.benchmark_group("matching_post_then_arrive");
    for outstanding in [10usize, 10_000] {
        // `outstanding` receives from distinct (source, tag) pairs stay posted; we measure one
        // more post + a matching arrival, which must not depend on how many are outstanding.
        let mut m: Matcher<u64, u64> = Matcher::new();
        for i in 0..outstanding {
            m.post(
                0,
                Some((i % 1000) as u32),
                Some((i / 1000) as i32 + 100),
                i as u64,
            );
        }
        g.bench_with_input(
            BenchmarkId::from_parameter(outstanding),
            &outstanding,
            |b, _| {
                b.iter(|| {
                    m.post(0, Some(7), Some(5), 1);
                    black_box(m.take_posted(0, 7, 5));
                })
            },
        );
    }
    for unexpected in [10usize, 10_000] {
        let mut m: Matcher<u64, u64> = Matcher::new();
        for i in 0..unexpected {
            m.add_unexpected(0, (i % 1000) as u32, (i / 1000) as i32 + 100, i as u64);
        }
        g.bench_with_input(
            BenchmarkId::new("unexpected_then_wildcard_recv", unexpected),
            &unexpected,
            |b, _| {
                b.iter(|| {
                    m.add_unexpected(0, 5000, 3, 1);
                    black_box(m.take_unexpected(0, None, Some(3)));
                })
            },
        );
    }
    g.finish();
}

fn datatypes(c: &mut Criterion) {
    let mut g = c.benchmark_group("datatype");
    let f64t = Datatype::of::<f64>();
    g.bench_function("commit_vector_1000x1_stride2", |b| {
        b.iter(|| black_box(Datatype::vector(1000, 1, 2, &f64t).unwrap().commit()))
    });
    let col = Datatype::vector(1000, 1, 2, &f64t).unwrap().commit();
    let src = vec![0u8; 16_000];
    let mut dst = vec![0u8; 8000];
    g.bench_function("pack_vector_1000x1_stride2", |b| {
        b.iter(|| col.pack(black_box(&src), 1, &mut dst).unwrap())
    });
    g.finish();
}

criterion_group!(benches, dispatch, matching, datatypes);
criterion_main!(benches);
