//! Failure probe for tests: a rank dies while a large message to a peer is in flight.
//!
//! Run with two ranks under `weft run --keep-going -n 2`. Rank 0 tells rank 1 to go, waits for
//! its answer, posts a large send (`FAULT_SIZE` bytes, default 256 MiB) and, `FAULT_SPIN_MS`
//! (default 20) later, is killed with SIGKILL from a thread of its own. Rank 1 receives it and
//! reports what it saw — the whole, correct message (the copy finished before the sender
//! vanished) or "peer failed" — then checks that a further receive from rank 0 fails with "peer
//! failed" too. Rank 1 exits 0 when both answers are acceptable and 1 otherwise; it never hangs
//! (set `WEFT_TIMEOUT`).

use std::process::ExitCode;
use std::time::{Duration, Instant};
use weft::ErrorKind;

// The providers that span processes.
use weft_limic as _;
use weft_shm as _;
use weft_tcp_sim as _;

fn pattern(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8 ^ (i >> 12) as u8)
        .collect()
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn verdict(r: &weft::Result<()>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(e) if e.kind() == ErrorKind::PeerFailed => "peer-failed".into(),
        Err(e) => format!("error: {e}"),
    }
}

fn main() -> ExitCode {
    let world = match weft::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("fault: {e}");
            return ExitCode::from(2);
        }
    };
    let size = env("FAULT_SIZE", 256 << 20) as usize;
    let spin = Duration::from_millis(env("FAULT_SPIN_MS", 20));
    if world.size() != 2 {
        eprintln!("fault: needs exactly 2 ranks");
        return ExitCode::from(2);
    }
    let data = pattern(size);
    if world.rank() == 0 {
        // A round trip first, so that the ranks are connected both ways before the kill: a
        // provider that connects lazily (tcp-sim) cannot tell who died on a connection that
        // never got as far as saying who it was from.
        let _ = world.send(&[1u8], 1, 1);
        let _ = world.recv(&mut [0u8], 1, 4);
        // The kill comes from another thread, so it lands wherever the send is, even inside
        // one long progress call.
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while t0.elapsed() < spin {
                std::hint::spin_loop();
            }
            if std::env::var_os("FAULT_DEBUG").is_some() {
                eprintln!("fault: rank 0 dies after {spin:?}");
            }
            // SAFETY: raising a signal at ourselves; the test wants this rank to die now.
            unsafe { libc::raise(libc::SIGKILL) };
        });
        let _ = world.send(&data, 1, 2);
        // Not reached unless the whole message went out before the kill.
        loop {
            std::hint::spin_loop();
        }
    }
    let mut go = [0u8];
    let first = world
        .recv(&mut go, 0, 1)
        .and_then(|_| world.send(&[1u8], 0, 4))
        .map(|_| ());
    let mut buf = vec![0u8; size];
    let big = first.and_then(|_| {
        let st = world.recv(&mut buf, 0, 2)?;
        if st.bytes != size || buf != data {
            return Err(weft::Error::invalid("the message arrived damaged"));
        }
        Ok(())
    });
    let after = world.recv(&mut go, 0, 3).map(|_| ());
    let (b, a) = (verdict(&big), verdict(&after));
    println!("fault: provider {}", world.provider_name());
    println!("fault: large receive: {b}");
    println!("fault: later receive: {a}");
    let ok = (b == "ok" || b == "peer-failed") && a == "peer-failed";
    // The final barrier cannot succeed with rank 0 gone; the error is expected.
    let _ = world.finalize();
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
