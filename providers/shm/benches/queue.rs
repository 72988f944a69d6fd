//! shm queue operations: one enqueue + one dequeue (copy out included), per queue flavour and
//! payload path (inline in the cell, or through the data area). Single thread: this is the
//! instruction cost of the protocol; cross-core costs show in `weft bench`.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use weft_shm::bench_api::{Flavour, Pair};

fn queue_ops(c: &mut Criterion) {
    let mut g = c.benchmark_group("shm_queue_send_recv");
    for (name, f) in [("ring", Flavour::Ring), ("mpsc", Flavour::Mpsc)] {
        // 8 B and 160 B travel inline; 1 KiB and 16 KiB through the data area.
        for size in [8usize, 160, 1024, 16 * 1024] {
            let mut p = Pair::new(f, 64, 512 * 1024);
            let payload = vec![7u8; size];
            let mut out = vec![0u8; size];
            g.throughput(Throughput::Bytes(size as u64));
            g.bench_with_input(BenchmarkId::new(name, size), &size, |b, _| {
                b.iter(|| {
                    assert!(p.send(black_box(b"hdr-0123"), black_box(&payload)));
                    black_box(p.recv(&mut out))
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, queue_ops);
criterion_main!(benches);
