//! `ring`: pass messages of several sizes around all ranks and verify every payload.
//!
//! ```text
//! cargo build --release --example ring
//! weft run -n 4 -- target/release/examples/ring
//! mpiexec.hydra -n 4 target/release/examples/ring
//! ```
//! Exits 0 when every payload arrived intact, 1 on any mismatch, 2 when weft cannot start.
//! `RING_LAPS` sets the laps per size (default 3). For failure tests, `RING_KILL_RANK=r` makes
//! rank r kill itself with SIGKILL in the middle of the ring; `RING_NO_FINALIZE=r` makes rank r
//! exit with status 0 right after start-up without finalizing.

use std::process::ExitCode;

// The providers that span processes.
use weft_hybrid as _;
use weft_limic as _;
use weft_ofi as _;
use weft_shm as _;
use weft_tcp_sim as _;
use weft_verbs_rc as _;
use weft_verbs_ud as _;

const SIZES: &[usize] = &[0, 1, 8, 100, 4096, 65_543, 1 << 20];

fn payload(size: usize, lap: usize) -> Vec<u8> {
    (0..size)
        .map(|i| {
            (i as u64)
                .wrapping_mul(2654435761)
                .wrapping_add(lap as u64 * 7 + size as u64) as u8
        })
        .collect()
}

fn run() -> weft::Result<u64> {
    let world = weft::init()?;
    let (r, n) = (world.rank(), world.size());
    let nodes = world.node_map();
    let laps: usize = std::env::var("RING_LAPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let kill: Option<u32> = std::env::var("RING_KILL_RANK")
        .ok()
        .and_then(|v| v.parse().ok());
    if std::env::var("RING_NO_FINALIZE")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        == Some(r)
    {
        std::process::exit(0);
    }
    let (left, right) = ((r + n - 1) % n, (r + 1) % n);
    let mut errors = 0u64;
    for (i, &size) in SIZES.iter().enumerate() {
        for lap in 0..laps {
            let tag = (i * 100 + lap) as i32;
            let expect = payload(size, lap);
            let mut buf = vec![0u8; size];
            if r == 0 {
                // sendrecv: with one rank, right == left == 0 and a blocking send to oneself
                // would wait for a receive that is not posted yet.
                world.sendrecv(&expect, right, tag, &mut buf, left, tag)?;
            } else {
                world.recv(&mut buf, left, tag)?;
                if kill == Some(r) && size >= 65_543 {
                    // SAFETY: raising a signal at ourselves; the test wants a rank to die.
                    unsafe { libc::raise(libc::SIGKILL) };
                }
                world.send(&buf, right, tag)?;
            }
            if buf != expect {
                let at = buf
                    .iter()
                    .zip(&expect)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                eprintln!("ring: rank {r}: {size}-byte payload of lap {lap} differs at byte {at}");
                errors += 1;
            }
        }
    }
    let mut total = [0u64];
    world.allreduce(&[errors], &mut total, weft::Op::Sum)?;
    if r == 0 {
        println!(
            "ring: {} over {} ranks on {} host(s), provider {}, {} sizes x {laps} laps",
            if total[0] == 0 { "ok" } else { "FAILED" },
            n,
            nodes.hosts(),
            world.provider_name(),
            SIZES.len()
        );
    }
    // What the provider carried, by path (a composed job counts host and network separately).
    let counts: Vec<String> = world
        .provider_counters()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    println!(
        "ring: rank {r} on host {} ok={}{}{}",
        nodes.my_host,
        errors == 0,
        if counts.is_empty() { "" } else { " " },
        counts.join(" ")
    );
    world.finalize()?;
    Ok(total[0])
}

fn main() -> ExitCode {
    match run() {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("ring: {e}");
            ExitCode::from(2)
        }
    }
}
