//! `verbs_peers`: the soft HCA's one-sided semantics between two processes (on one host, or on
//! two hosts), with the target in no HCA call while the initiator works on its memory.
//!
//! ```text
//! weft run -n 2 -- target/release/examples/verbs_peers
//! mpiexec.hydra -n 2 -ppn 1 -hosts a,b target/release/examples/verbs_peers
//! ```
//! Rank 0 writes 32 KiB into rank 1's registered buffer, reads it back, fetch-adds twice,
//! sends into a receive rank 1 posted, and finally writes with a wrong key; rank 1 meanwhile
//! waits in a weft receive (not in the HCA) and then checks its memory, its completions, that
//! the bad write touched nothing and that its QP went to the error state. The job's provider
//! carries only the set-up messages. Prints one `verbs_peers: rank R ok ...` line per rank;
//! exits 0 when everything held, 1 otherwise, 2 when weft cannot start.

use std::process::ExitCode;
use std::time::Duration;
use weft_verbs::*;

// The providers that span processes (the set-up exchange).
use weft_shm as _;
use weft_tcp_sim as _;

const LEN: usize = 64 << 10;
const PART: usize = 32 << 10;
const ATOMIC_AT: usize = 40_000;
const BAD_AT: usize = 48 << 10;
const RECV_AT: usize = 60 << 10;
const T: Duration = Duration::from_secs(30);

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) % 251) as u8
}

fn fail(what: String) -> weft::Error {
    weft::Error::invalid(format!("verbs_peers: {what}"))
}

fn expect(w: &Wc, st: WcStatus, what: &str) -> weft::Result<()> {
    if w.status != st {
        return Err(fail(format!("{what}: {} (expected {st})", w.status)));
    }
    Ok(())
}

fn run() -> weft::Result<()> {
    let world = weft::init()?;
    if world.size() != 2 {
        return Err(fail("run it with two ranks".into()));
    }
    let (r, peer) = (world.rank(), 1 - world.rank());
    let hca = open_default()?;
    let pd = hca.alloc_pd()?;
    let cq = hca.create_cq(64)?;
    let qp = hca.create_qp(
        pd,
        &QpInitAttr {
            qp_type: QpType::Rc,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: QpCap::default(),
            sq_sig_all: true,
        },
    )?;
    let mut buf = vec![0u8; LEN].into_boxed_slice();
    if r == 0 {
        for (i, b) in buf[..PART].iter_mut().enumerate() {
            *b = pattern(i);
        }
    }
    // SAFETY: `buf` outlives the registration (deregistered before it is dropped) and is read
    // here only once the peer has said it is done with it.
    let mr = unsafe { hca.reg_mr(pd, buf.as_mut_ptr(), LEN, Access::ALL)? };
    // Exchange endpoint, buffer address and key over the job's provider.
    let mine = format!(
        "{} {:x} {:x}",
        Endpoint::of(&*hca, qp, 100 + r),
        mr.addr,
        mr.rkey
    );
    let mut got = vec![0u8; 256];
    let st = world.sendrecv(mine.as_bytes(), peer, 1, &mut got, peer, 1)?;
    let theirs = String::from_utf8_lossy(&got[..st.bytes]).into_owned();
    let f: Vec<&str> = theirs.split(' ').collect();
    let (ep, addr, rkey) = match f.as_slice() {
        [e, a, k] => (
            e.parse::<Endpoint>()?,
            u64::from_str_radix(a, 16).map_err(|_| fail("bad address".into()))?,
            u32::from_str_radix(k, 16).map_err(|_| fail("bad key".into()))?,
        ),
        _ => return Err(fail(format!("bad set-up message '{theirs}'"))),
    };
    connect_rc(&*hca, qp, 100 + r, &ep, &RcParams::default())?;
    if r == 1 {
        hca.post_recv(qp, &[RecvWr::new(9, &[mr.sge(RECV_AT, 64)])])?;
    }
    world.barrier()?;

    if r == 0 {
        let one = |wr: SendWr, st: WcStatus, what: &str| -> weft::Result<()> {
            hca.post_send(qp, &[wr])?;
            expect(&wait_cq(&*hca, cq, 1, T)?[0], st, what)
        };
        one(
            SendWr::write(1, &[mr.sge(0, PART)], addr, rkey),
            WcStatus::Success,
            "write",
        )?;
        one(
            SendWr::read(2, &[mr.sge(PART, PART)], addr, rkey),
            WcStatus::Success,
            "read",
        )?;
        if buf[PART..2 * PART] != buf[..PART] {
            return Err(fail("the read did not bring back what was written".into()));
        }
        for (k, want) in [(3u64, 0u64), (4, 5)] {
            one(
                SendWr::fetch_add(k, mr.sge(BAD_AT, 8), addr + ATOMIC_AT as u64, rkey, 5),
                WcStatus::Success,
                "fetch-add",
            )?;
            let old = u64::from_ne_bytes(buf[BAD_AT..BAD_AT + 8].try_into().unwrap_or_default());
            if old != want {
                return Err(fail(format!("fetch-add returned {old}, expected {want}")));
            }
        }
        // (The read above filled our upper half; no request runs now.)
        buf[RECV_AT..RECV_AT + 64].fill(0x5a);
        one(
            SendWr::send(5, &[mr.sge(RECV_AT, 64)]),
            WcStatus::Success,
            "send",
        )?;
        world.send(&[1u8], peer, 2)?;
        world.recv(&mut [0u8], peer, 3)?;
        one(
            SendWr::write(6, &[mr.sge(0, 8192)], addr + BAD_AT as u64, rkey ^ 0x100),
            WcStatus::RemAccessErr,
            "write with a wrong key",
        )?;
        world.send(&[1u8], peer, 4)?;
    } else {
        // Not in any HCA call while rank 0 works on our memory.
        world.recv(&mut [0u8], peer, 2)?;
        if (0..PART).any(|i| buf[i] != pattern(i)) {
            return Err(fail("the written bytes are wrong".into()));
        }
        let v = u64::from_ne_bytes(buf[ATOMIC_AT..ATOMIC_AT + 8].try_into().unwrap_or_default());
        if v != 10 {
            return Err(fail(format!("after two fetch-adds of 5 the word is {v}")));
        }
        let w = wait_cq(&*hca, cq, 1, T)?[0];
        expect(&w, WcStatus::Success, "the receive")?;
        if w.wr_id != 9 || w.byte_len != 64 || buf[RECV_AT..RECV_AT + 64].iter().any(|b| *b != 0x5a)
        {
            return Err(fail(format!("wrong receive completion {w:?}")));
        }
        world.send(&[1u8], peer, 3)?;
        world.recv(&mut [0u8], peer, 4)?;
        if buf[BAD_AT..BAD_AT + 8192].iter().any(|b| *b != 0) {
            return Err(fail("a write with a wrong key touched memory".into()));
        }
        if hca.query_qp_state(qp)? != QpState::Err {
            return Err(fail("the QP did not go to the error state".into()));
        }
    }
    world.barrier()?;
    let c = hca.counters();
    println!(
        "verbs_peers: rank {r} ok on host {} device {} (requests served for other hosts: {})",
        world.node_map().my_host,
        hca.attr().name,
        c.remote_served
    );
    hca.dereg_mr(mr)?;
    drop(buf);
    world.finalize()
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("verbs_peers: {e}");
            ExitCode::from(1)
        }
    }
}
