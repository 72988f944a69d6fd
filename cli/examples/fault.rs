//! Failure probes for tests, launched with `weft run --keep-going`. `FAULT_CASE` picks one:
//!
//! * `send` (default, 2 ranks): rank 0 posts a large send (`FAULT_SIZE` bytes, default 256 MiB)
//!   and, `FAULT_SPIN_MS` (default 20) later, is killed with SIGKILL from a thread of its own.
//!   Rank 1 receives it and reports what it saw — the whole, correct message (the copy
//!   finished before the sender vanished) or "peer failed" — then checks that a further
//!   receive from rank 0 fails with "peer failed" too.
//! * `lock` (3 ranks): rank 1 takes an exclusive lock on rank 0's window and is killed while
//!   it holds it. Rank 2 then locks the same window: it must get the lock (released, or taken
//!   over from the dead holder), not wait for good. `FAULT_WINDOW=alloc` uses an allocated
//!   window (on shm: native locks in shared memory), otherwise one over user memory.
//! * `finalize` (4 ranks): rank 1 dies while the others finalize; each returns "peer failed".
//! * `collective` (3 ranks): rank 1 is killed while ranks 0 and 2 are in a barrier, then an
//!   allreduce, then a window fence: all must fail with "peer failed", not hang.
//!
//! The surviving ranks print their verdicts and exit 0 when they are acceptable, 1 otherwise;
//! nothing hangs (set `WEFT_TIMEOUT`).

use std::process::ExitCode;
use std::time::{Duration, Instant};
use weft::ErrorKind;

// The providers that span processes.
use weft_hybrid as _;
use weft_limic as _;
use weft_ofi as _;
use weft_shm as _;
use weft_tcp_sim as _;
use weft_verbs_rc as _;
use weft_verbs_ud as _;

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
    let case = std::env::var("FAULT_CASE").unwrap_or_else(|_| "send".into());
    let want = match case.as_str() {
        "send" => 2,
        "finalize" => 4,
        _ => 3,
    };
    if world.size() != want {
        eprintln!("fault: case {case} needs exactly {want} ranks");
        return ExitCode::from(2);
    }
    println!("fault: provider {}", world.provider_name());
    println!("fault: rank {} pid {}", world.rank(), std::process::id());
    match case.as_str() {
        "send" => send_case(world),
        "lock" => lock_case(world),
        "collective" => collective_case(world),
        "finalize" => finalize_case(world),
        other => {
            eprintln!("fault: unknown FAULT_CASE {other}");
            ExitCode::from(2)
        }
    }
}

/// Die now, with no chance to say goodbye.
fn die() -> ! {
    if std::env::var_os("FAULT_DEBUG").is_some() {
        eprintln!("fault: rank dies");
    }
    // SAFETY: raising a signal at ourselves; the test wants this rank to die now.
    unsafe { libc::raise(libc::SIGKILL) };
    unreachable!("SIGKILL returned")
}

fn lock_case(world: weft::World) -> ExitCode {
    let alloc = std::env::var("FAULT_WINDOW").is_ok_and(|v| v == "alloc");
    let r = world.rank();
    let mut mem = vec![0u64; 4];
    let body = |win: &weft::Window<'_, weft::DynProvider>| -> weft::Result<ExitCode> {
        match r {
            1 => {
                win.lock_epoch(0, weft::LockKind::Exclusive, |e| {
                    e.put(&[11u64], 0, 0)?;
                    e.flush(0)?;
                    // Tell rank 2 the lock is held, then die holding it.
                    world.send(&[1u8], 2, 7)?;
                    die()
                })?;
                unreachable!()
            }
            2 => {
                world.recv(&mut [0u8], 1, 7)?;
                let got = win.lock_epoch(0, weft::LockKind::Exclusive, |e| {
                    e.put(&[22u64], 0, 1)?;
                    e.flush(0)
                });
                println!("fault: lock after holder died: {}", verdict(&got));
                world.send(&[got.is_ok() as u8], 0, 8)?;
                Ok(if got.is_ok() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                })
            }
            _ => {
                // Serve the window (the active-message path needs this rank's progress)
                // until rank 2 has its answer.
                let mut ok = [0u8];
                world.recv(&mut ok, 2, 8)?;
                Ok(ExitCode::SUCCESS)
            }
        }
    };
    let code = if alloc {
        world
            .win_allocate::<u64>(4, weft::WinInfo::default())
            .and_then(|w| {
                let c = body(&w);
                // Freeing is collective and rank 1 is gone: its error is expected.
                let _ = w.free();
                c
            })
    } else {
        let mut code = ExitCode::from(1);
        let _ = world.win_create(&mut mem, weft::WinInfo::default(), |w| {
            code = body(w)?;
            Ok(())
        });
        Ok(code)
    };
    let _ = world.finalize();
    code.unwrap_or_else(|e| {
        println!("fault: rank {r}: {e}");
        ExitCode::from(1)
    })
}

fn collective_case(world: weft::World) -> ExitCode {
    // Everyone connected both ways first (lazy providers learn who a dead peer was).
    let mut one = [0u64];
    if world.allreduce(&[1u64], &mut one, weft::Op::Sum).is_err() {
        return ExitCode::from(1);
    }
    let r = world.rank();
    let mut mem = vec![0u64; 4];
    let mut ok = false;
    // A window made while everyone lives; rank 1 dies inside it.
    let _ = world.win_create(&mut mem, weft::WinInfo::default(), |win| {
        // Rank 1 dies once both survivors are inside the window. (Dying as soon as its own
        // part of the window's creation was done could lose messages it had queued but not
        // yet written out, and a survivor would fail in the creation, before the collectives
        // under test: seen with tcp-sim in release builds.)
        if r == 1 {
            let mut b = [0u8];
            world.recv(&mut b, 0, 9)?;
            world.recv(&mut b, 2, 9)?;
            die();
        }
        world.send(&[1u8], 1, 9)?;
        let b = world.barrier();
        let mut sum = [0u64];
        let a = world
            .allreduce(&[1u64], &mut sum, weft::Op::Sum)
            .map(|_| ());
        // A fence waits for every rank's word that it has reached it. (No operation in it:
        // the other survivor may already have left the window, and a put into it would fail
        // for that reason instead.)
        let f = win.fence(weft::Assert::NONE);
        println!("fault: rank {r} barrier: {}", verdict(&b));
        println!("fault: rank {r} allreduce: {}", verdict(&a));
        println!("fault: rank {r} fence: {}", verdict(&f));
        ok = [b, a, f].iter().all(|x| verdict(x) == "peer-failed");
        Ok(())
    });
    let _ = world.finalize();
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Rank 1 dies once the others are about to finalize. In finalize's barrier (4 ranks,
/// dissemination) rank 2 waits for a message from rank 1 that will never come, while ranks 0
/// and 3 have one to send to it: every survivor must come back with "peer failed", without
/// `WEFT_TIMEOUT`.
fn finalize_case(world: weft::World) -> ExitCode {
    let mut one = [0u64];
    if world.allreduce(&[1u64], &mut one, weft::Op::Sum).is_err() {
        return ExitCode::from(1);
    }
    let r = world.rank();
    let mut b = [0u8];
    if r == 1 {
        for peer in [0, 2, 3] {
            if world.recv(&mut b, peer, 9).is_err() {
                return ExitCode::from(1);
            }
        }
        die();
    }
    if world.send(&[1u8], 1, 9).is_err() {
        return ExitCode::from(1);
    }
    let f = world.finalize();
    println!("fault: rank {r} finalize: {}", verdict(&f));
    if verdict(&f) == "peer-failed" {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn send_case(world: weft::World) -> ExitCode {
    let size = env("FAULT_SIZE", 256 << 20) as usize;
    let spin = Duration::from_millis(env("FAULT_SPIN_MS", 20));
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
