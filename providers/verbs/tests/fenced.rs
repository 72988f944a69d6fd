//! A peer that dies or stops in the middle of an access to this process's HCA holds nothing
//! up for longer than the fence time: a ring slot it claimed and never published (or never
//! handed back) is reclaimed by the owner, and a peer stopped while holding a queue slot or a
//! memory region past `WEFT_VERBS_SOFT_FENCE` is fenced out (killed). Before, the CQ stayed
//! empty (or the receive queue full) for every peer, for good, and `dereg_mr` spun forever
//! holding the HCA's lock.
//!
//! Each test runs a child (this binary again, one `child` test) that attaches to the parent's
//! HCA and stops or exits at a stall point (`soft::model::Stall`) in the middle of its access.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use weft_verbs::soft::model::{stall_at, Config, Stall};
use weft_verbs::soft::SoftHca;
use weft_verbs::*;

const CHILD: &str = "WEFT_TEST_FENCED_CHILD";
const T: Duration = Duration::from_secs(30);

fn qp(h: &SoftHca, pd: Pd, cq: Cq, srq: Option<Srq>) -> Qp {
    h.create_qp(
        pd,
        &QpInitAttr {
            qp_type: QpType::Rc,
            send_cq: cq,
            recv_cq: cq,
            srq,
            cap: QpCap {
                max_recv_wr: 2,
                ..QpCap::default()
            },
            sq_sig_all: true,
        },
    )
    .unwrap()
}

fn params() -> RcParams {
    RcParams {
        timeout: 10,
        retry_cnt: 1,
        ..RcParams::default()
    }
}

/// The child: connect an RC QP to the parent's (`EP` in the environment), say its own, and
/// on "go" arm the stall and send (or write into the parent's region `MR`).
#[test]
fn child() {
    let Ok(mode) = std::env::var(CHILD) else {
        return;
    };
    let to: Endpoint = std::env::var("EP").unwrap().parse().unwrap();
    let h = SoftHca::with_config(Config {
        addr: "off".into(),
        ..Config::default()
    })
    .unwrap();
    let pd = h.alloc_pd().unwrap();
    let cq = h.create_cq(16).unwrap();
    let q = qp(&h, pd, cq, None);
    connect_rc(&h, q, 5, &to, &params()).unwrap();
    println!("EP {}", Endpoint::of(&h, q, 5));
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let mut src = [0x5au8; 64];
    // SAFETY: `src` lives until the process ends (it exits or is killed in the post below).
    let mr = unsafe { h.reg_mr(pd, src.as_mut_ptr(), 64, Access::ALL) }.unwrap();
    let wr = match mode.as_str() {
        "write" => {
            let (addr, rkey) = std::env::var("MR")
                .unwrap()
                .split_once(':')
                .map(|(a, k)| (a.parse::<u64>().unwrap(), k.parse::<u32>().unwrap()))
                .unwrap();
            stall_at(Stall::StopInAccess);
            SendWr::write(1, &[mr.sge(0, 64)], addr, rkey)
        }
        m => {
            stall_at(match m {
                "exit-push" => Stall::ExitInPush,
                "stop-push" => Stall::StopInPush,
                _ => Stall::ExitInPop,
            });
            SendWr::send(1, &[mr.sge(0, 64)])
        }
    };
    h.post_send(q, &[wr]).unwrap();
    // Not reached when the stall fires.
    let _ = wait_cq(&h, cq, 1, T);
    std::process::exit(3);
}

/// A child that is killed (and reaped) when the test ends, however it ends: a failing test
/// leaves no stopped process behind.
struct Kid(Child);

impl std::ops::Deref for Kid {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Kid {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start the child in `mode` against the parent's QP `ep` (and region `mr`), connect `q` to
/// its QP, let it go.
fn start(mode: &str, h: &SoftHca, q: Qp, ep: Endpoint, mr: Option<&Mr>) -> Kid {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child", "--nocapture"])
        .env(CHILD, mode)
        .env("EP", ep.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if let Some(m) = mr {
        c.env("MR", format!("{}:{}", m.addr, m.rkey));
    }
    let mut child = c.spawn().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let theirs: Endpoint = out
        .lines()
        .map_while(|l| l.ok())
        .find_map(|l| l.strip_prefix("EP ").map(|e| e.parse().unwrap()))
        .expect("the child said its endpoint");
    connect_rc(h, q, 7, &theirs, &params()).unwrap();
    writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
    Kid(child)
}

fn state(pid: u32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit(')').next()?.trim_start().chars().next()
}

/// Wait (bounded) until the child is stopped or has exited.
fn until_state(c: &Kid, want: &[char]) {
    let t0 = Instant::now();
    while !state(c.id()).is_some_and(|s| want.contains(&s)) {
        assert!(
            t0.elapsed() < T,
            "child state {:?}, not {want:?}",
            state(c.id())
        );
        std::thread::yield_now();
    }
}

/// The parent: one HCA with a CQ and an SRQ that two QPs share, `a` for the child and `b`
/// fed by a local QP `c`, so that completions and receives keep coming after the child is
/// gone.
struct Parent {
    h: SoftHca,
    pd: Pd,
    cq: Cq,
    srq: Srq,
    a: Qp,
    b: Qp,
    c: Qp,
    mr: Mr,
    _buf: Box<[u8]>,
}

fn parent(fence: Option<Duration>) -> Parent {
    let h = SoftHca::with_config(Config {
        addr: "off".into(),
        fence,
        ..Config::default()
    })
    .unwrap();
    let pd = h.alloc_pd().unwrap();
    let cq = h.create_cq(64).unwrap();
    let srq = h.create_srq(pd, 2, 1).unwrap();
    let a = qp(&h, pd, cq, Some(srq));
    let b = qp(&h, pd, cq, Some(srq));
    let ccq = h.create_cq(64).unwrap();
    let c = qp(&h, pd, ccq, None);
    connect_rc(&h, b, 1, &Endpoint::of(&h, c, 2), &params()).unwrap();
    connect_rc(&h, c, 2, &Endpoint::of(&h, b, 1), &params()).unwrap();
    let mut buf = vec![0u8; 4096].into_boxed_slice();
    // SAFETY: the buffer lives as long as the registration (the struct owns both).
    let mr = unsafe { h.reg_mr(pd, buf.as_mut_ptr(), 4096, Access::ALL) }.unwrap();
    Parent {
        h,
        pd,
        cq,
        srq,
        a,
        b,
        c,
        mr,
        _buf: buf,
    }
}

impl Parent {
    fn post_recv(&self, id: u64) -> Result<(), weft_provider::Error> {
        self.h.post_srq_recv(
            self.srq,
            &[RecvWr::new(id, &[self.mr.sge(64 * id as usize, 64)])],
        )
    }

    /// A local send `c` → `b`, and its completion on `c`'s CQ.
    fn local_send(&self, id: u64) {
        self.h
            .post_send(self.c, &[SendWr::send(id, &[self.mr.sge(2048, 8)])])
            .unwrap();
    }

    /// Poll the CQ until `n` completions, bounded (at least once: `n` = 0 takes what is there).
    fn poll(&self, n: usize) -> Vec<Wc> {
        let mut got = Vec::new();
        let mut w = [Wc {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            imm: None,
            qp_num: 0,
            src_qp: 0,
            grh: false,
        }; 8];
        let t0 = Instant::now();
        loop {
            let k = self.h.poll_cq(self.cq, &mut w).unwrap();
            got.extend_from_slice(&w[..k]);
            if got.len() >= n {
                return got;
            }
            assert!(t0.elapsed() < T, "only {got:?} of {n} completions");
        }
    }
}

/// The child claims a slot of the parent's CQ for its receive's completion and exits: the
/// parent voids the slot and gets the completions behind it.
#[test]
fn a_producer_gone_between_claim_and_publish_does_not_stop_the_cq() {
    let p = parent(None);
    p.post_recv(0).unwrap();
    p.post_recv(1).unwrap();
    let mut child = start("exit-push", &p.h, p.a, Endpoint::of(&p.h, p.a, 7), None);
    assert!(child.wait().unwrap().success(), "exited at the stall point");
    p.local_send(9);
    let w = p.poll(1);
    assert_eq!((w[0].qp_num, w[0].status), (p.b.qpn, WcStatus::Success));
}

/// The same with the child stopped (SIGSTOP) rather than gone: after the fence time it is
/// killed, and the CQ goes on.
#[test]
fn a_producer_stopped_between_claim_and_publish_is_fenced_out() {
    let fence = Duration::from_millis(500);
    let p = parent(Some(fence));
    p.post_recv(0).unwrap();
    p.post_recv(1).unwrap();
    let mut child = start("stop-push", &p.h, p.a, Endpoint::of(&p.h, p.a, 7), None);
    until_state(&child, &['T', 't']);
    let t0 = Instant::now();
    p.local_send(9);
    let w = p.poll(1);
    let took = t0.elapsed();
    assert_eq!((w[0].qp_num, w[0].status), (p.b.qpn, WcStatus::Success));
    assert!(took >= fence, "the live claim was waited for ({took:?})");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        child.wait().unwrap().signal(),
        Some(libc::SIGKILL),
        "fenced out"
    );
}

/// The child takes a receive from the parent's SRQ and exits before handing its slot back:
/// once the parent's posts come round to that slot, the receive completes with a flush error
/// and the slot takes the next one (it used to stay full for good).
#[test]
fn a_consumer_gone_between_claim_and_release_does_not_fill_the_queue() {
    let p = parent(None);
    p.post_recv(0).unwrap();
    p.post_recv(1).unwrap();
    let mut child = start("exit-pop", &p.h, p.a, Endpoint::of(&p.h, p.a, 7), None);
    assert!(child.wait().unwrap().success(), "exited at the stall point");
    // Receives 1, 2, 3 taken by local sends; posting the fifth reaches slot 0 again.
    let mut flushed = Vec::new();
    let mut note = |ws: Vec<Wc>| {
        flushed.extend(
            ws.iter()
                .filter(|w| w.status == WcStatus::WrFlushErr)
                .map(|w| w.wr_id),
        )
    };
    for id in 2..8u64 {
        p.local_send(id);
        note(p.poll(1));
        let t0 = Instant::now();
        while p.post_recv(id).is_err() {
            note(p.poll(0));
            assert!(t0.elapsed() < T, "the SRQ stays full");
        }
    }
    note(p.poll(0));
    assert_eq!(flushed, vec![0], "the receive the dead child took, flushed");
}

/// The child stops while holding a hazard on the parent's region (its write checked the key,
/// not yet copied): `dereg_mr` returns after the fence time, the child killed, the region
/// untouched.
#[test]
fn a_peer_stopped_inside_a_region_is_fenced_out_and_deregistration_returns() {
    let fence = Duration::from_millis(500);
    let p = parent(Some(fence));
    let child_ep = Endpoint::of(&p.h, p.a, 7);
    let mut buf = vec![0u8; 64].into_boxed_slice();
    // SAFETY: `buf` outlives the registration (deregistered below).
    let mr = unsafe { p.h.reg_mr(p.pd, buf.as_mut_ptr(), 64, Access::ALL) }.unwrap();
    let mut child = start("write", &p.h, p.a, child_ep, Some(&mr));
    until_state(&child, &['T', 't']);
    let t0 = Instant::now();
    p.h.dereg_mr(mr).unwrap();
    let took = t0.elapsed();
    assert!(took >= fence && took < T, "dereg_mr took {took:?}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        child.wait().unwrap().signal(),
        Some(libc::SIGKILL),
        "fenced out"
    );
    assert!(buf.iter().all(|&b| b == 0), "the region was not written");
}
