//! `rdgram`: a minimal weft provider in Rust, active messages only, over abstract-namespace
//! UNIX datagram sockets (one per rank, named from the job id and the rank; nothing appears in
//! the filesystem). Datagrams between a pair arrive in order and a full receiver queue makes the
//! sender see EAGAIN, which becomes `Busy` — exactly the contract's flow control.
//!
//! Build it as a cdylib and install it as `libweft-rdgram.so` in a directory named by
//! `WEFT_PROVIDER_PATH`.

use std::collections::VecDeque;
use std::io::IoSlice;
use weft_provider::bootstrap::Bootstrap;
use weft_provider::provider::{Caps, ProbeContext, Provider, SendOutcome, Sink, StaticProvider};
use weft_provider::{Error, Rank, Result};

const MAX_HEADER: usize = 64;
const MAX_PAYLOAD: usize = 8192;
/// Message prefix: source rank (u32) and header length (u16).
const PREFIX: usize = 6;

pub struct Dgram {
    fd: i32,
    rank: Rank,
    size: u32,
    caps: Caps,
    peers: Vec<(libc::sockaddr_un, libc::socklen_t)>,
    selfq: VecDeque<(Vec<u8>, Vec<u8>)>,
    buf: Vec<u8>,
}

/// The abstract socket address of `rank` in `job`.
fn address(job: &str, rank: Rank) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain data.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let name = format!("weft-rdgram-{job}-{rank}");
    let bytes = name.as_bytes();
    let n = bytes.len().min(a.sun_path.len() - 1);
    // Abstract namespace: sun_path[0] = 0, then the name (not NUL-terminated).
    for (i, b) in bytes[..n].iter().enumerate() {
        a.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + n) as libc::socklen_t;
    (a, len)
}

fn caps() -> Caps {
    let mut c = Caps::am_only(MAX_HEADER, MAX_PAYLOAD, 8);
    c.spans_processes = true;
    c
}

impl StaticProvider for Dgram {
    const NAME: &'static str = "rdgram";

    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String> {
        if ctx.hosts > 1 {
            return Err("UNIX sockets reach only ranks on one host".into());
        }
        Ok(())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        let (rank, size) = (boot.rank(), boot.size());
        let job = boot.job_id().to_string();
        // SAFETY: plain socket(2) call.
        let fd = unsafe {
            libc::socket(
                libc::AF_UNIX,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if fd < 0 {
            return Err(Error::last_os("rdgram: socket"));
        }
        let (a, len) = address(&job, rank);
        // SAFETY: binding our socket to a valid address of the given length.
        if unsafe { libc::bind(fd, &a as *const _ as *const libc::sockaddr, len) } != 0 {
            let e = Error::last_os(format!("rdgram: bind rank {rank}"));
            // SAFETY: closing our own fd.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        // Everyone is bound before anyone sends.
        boot.fence()?;
        Ok(Dgram {
            fd,
            rank,
            size,
            caps: caps(),
            peers: (0..size).map(|r| address(&job, r)).collect(),
            selfq: VecDeque::new(),
            buf: vec![0u8; PREFIX + MAX_HEADER + MAX_PAYLOAD],
        })
    }

    fn static_caps() -> Result<Caps> {
        Ok(caps())
    }
}

impl Drop for Dgram {
    fn drop(&mut self) {
        // SAFETY: closing our own fd once.
        unsafe { libc::close(self.fd) };
    }
}

impl Provider for Dgram {
    fn name(&self) -> &str {
        "rdgram"
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn rank(&self) -> Rank {
        self.rank
    }
    fn size(&self) -> u32 {
        self.size
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        if dest >= self.size || header.len() > MAX_HEADER || payload.len() > 7 {
            return Err(Error::invalid("rdgram: bad destination, header or iovec"));
        }
        if dest == self.rank {
            let data: Vec<u8> = payload.iter().flat_map(|s| s.iter().copied()).collect();
            self.selfq.push_back((header.to_vec(), data));
            return Ok(SendOutcome::Sent);
        }
        let mut prefix = [0u8; PREFIX];
        prefix[..4].copy_from_slice(&self.rank.to_le_bytes());
        prefix[4..].copy_from_slice(&(header.len() as u16).to_le_bytes());
        let mut iov = vec![
            libc::iovec {
                iov_base: prefix.as_ptr() as *mut _,
                iov_len: PREFIX,
            },
            libc::iovec {
                iov_base: header.as_ptr() as *mut _,
                iov_len: header.len(),
            },
        ];
        iov.extend(payload.iter().map(|s| libc::iovec {
            iov_base: s.as_ptr() as *mut _,
            iov_len: s.len(),
        }));
        let (a, len) = &self.peers[dest as usize];
        // SAFETY: msghdr built from valid buffers and address for the duration of the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_name = a as *const _ as *mut _;
        msg.msg_namelen = *len;
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len();
        // SAFETY: see above.
        let r = unsafe { libc::sendmsg(self.fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if r >= 0 {
            return Ok(SendOutcome::Sent);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::ENOBUFS) => Ok(SendOutcome::Busy),
            Some(libc::ECONNREFUSED) | Some(libc::ENOENT) => {
                Err(Error::peer_failed(dest, "its socket is gone"))
            }
            _ => Err(Error::io("rdgram: sendmsg", e)),
        }
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = 0;
        while let Some((h, d)) = self.selfq.pop_front() {
            sink.am(self.rank, &h, &d);
            n += 1;
        }
        loop {
            // SAFETY: receiving into our buffer of the given length.
            let r = unsafe {
                libc::recv(
                    self.fd,
                    self.buf.as_mut_ptr() as *mut _,
                    self.buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if matches!(e.raw_os_error(), Some(libc::EAGAIN)) {
                    return Ok(n);
                }
                return Err(Error::io("rdgram: recv", e));
            }
            let m = &self.buf[..r as usize];
            if m.len() < PREFIX {
                continue; // not ours
            }
            let src = u32::from_le_bytes(m[..4].try_into().unwrap());
            let hl = u16::from_le_bytes(m[4..6].try_into().unwrap()) as usize;
            if src >= self.size || PREFIX + hl > m.len() {
                continue; // malformed: dropped
            }
            sink.am(src, &m[PREFIX..PREFIX + hl], &m[PREFIX + hl..]);
            n += 1;
        }
    }
}

weft_provider::export_provider!(
    Dgram,
    name = "rdgram",
    priority = 5,
    summary = "example Rust provider: UNIX datagram sockets"
);
