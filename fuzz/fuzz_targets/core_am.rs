//! The core's active-message handlers (`weft::engine`'s dispatch, then `p2p` and `rma`: every
//! header a peer sends is read with `am::codec::Rd` inside the handler of its kind): any
//! header and payload a peer delivers must leave the rank standing — a malformed one fails
//! that peer, never panics, hangs or touches memory it should not.
//!
//! A world of one over loopback with a window open and a receive posted, and a provider that
//! delivers the input once, as a message from rank 0, at the first progress call. The first
//! input byte is the header's length; the rest is the header, then the payload.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::io::IoSlice;
use std::time::Duration;
use weft::bootstrap::Singleton;
use weft::provider::{Caps, Provider, SendOutcome, Sink};
use weft::{EngineConfig, Rank, Result, WinInfo, World, ANY_SOURCE, ANY_TAG};
use weft_loopback::{Loopback, LoopbackConfig};

struct Inject {
    inner: Loopback,
    pending: Option<(Vec<u8>, Vec<u8>)>,
}

impl Provider for Inject {
    fn name(&self) -> &str {
        "inject"
    }
    fn caps(&self) -> &Caps {
        self.inner.caps()
    }
    fn rank(&self) -> Rank {
        self.inner.rank()
    }
    fn size(&self) -> u32 {
        self.inner.size()
    }
    fn am_send(&mut self, dest: Rank, h: &[u8], p: &[IoSlice<'_>]) -> Result<SendOutcome> {
        self.inner.am_send(dest, h, p)
    }
    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let n = self.inner.progress(sink)?;
        match self.pending.take() {
            Some((h, p)) => {
                sink.am(0, &h, &p);
                Ok(n + 1)
            }
            None => Ok(n),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let mut boot = Singleton::new();
    let inner = Loopback::open_with(&mut boot, &LoopbackConfig::default()).expect("loopback");
    let n = (n as usize).min(rest.len()).min(inner.caps().max_am_header);
    let (h, p) = rest.split_at(n);
    let p = &p[..p.len().min(inner.caps().max_am_payload)];
    let inject = Inject {
        inner,
        pending: Some((h.to_vec(), p.to_vec())),
    };
    let cfg = EngineConfig {
        // Whatever the message started (a rendezvous, a lock, a fence) ends within this.
        timeout: Some(Duration::from_millis(200)),
        ..EngineConfig::default()
    };
    let world = World::from_parts(inject, Box::new(boot), cfg).expect("a world of one");
    let comm = world.comm();
    let win = comm
        .win_allocate::<u64>(64, WinInfo::default())
        .expect("a window");
    let mut buf = [0u8; 4096];
    comm.scope(|s| {
        let mut r = comm
            .irecv(s, &mut buf, ANY_SOURCE, ANY_TAG)
            .expect("a receive");
        let _ = comm.progress();
        let _ = comm.progress();
        let _ = comm.iprobe(ANY_SOURCE, ANY_TAG);
        // Matched (an eager message for it), failed (the peer was failed), or still
        // pending: then cancelled, and the scope's end completes it.
        if let Ok(None) = r.test() {
            let _ = r.cancel();
        }
    });
    drop(win);
    let _ = world.finalize();
});
