//! PMI-1 client: the simple wire protocol spoken by MPICH's Hydra, Slurm and `weft run`.
//!
//! The launcher hands each rank a connected socket in `PMI_FD` (or an address in `PMI_PORT`
//! plus `PMI_ID`), and its rank and size in `PMI_RANK` / `PMI_SIZE`. Requests and responses are
//! single lines of space-separated `key=value` tuples, in lock-step.
//!
//! Values longer than the server's `vallen_max` are split over several keys and joined again
//! transparently; characters PMI values may not carry (space, `=`, control bytes, non-ASCII) are
//! escaped as `%XX`.
//!
//! Size (over 800 lines): with its tests (wire-format property tests against a scripted server);
//! the client alone is about 650 lines.

use super::{host_id, Bootstrap, KvSpace, NodeMap};
use crate::types::Rank;
use crate::{Error, ErrorDetail, Result};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::io::FromRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Parsed `key=value` tuples of one PMI line, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    pub fields: Vec<(String, String)>,
}

impl Line {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The command name (`cmd=` or, for spawn, `mcmd=`).
    pub fn cmd(&self) -> &str {
        self.get("cmd").or_else(|| self.get("mcmd")).unwrap_or("")
    }

    /// `rc` as an integer (absent means 0).
    pub fn rc(&self) -> Result<i64> {
        match self.get("rc") {
            None => Ok(0),
            Some(v) => v.parse().map_err(|_| {
                Error::from(ErrorDetail::Bootstrap(format!(
                    "bad rc '{v}' in PMI response"
                )))
            }),
        }
    }

    /// Format back into a wire line (with the trailing newline).
    pub fn to_wire(&self) -> String {
        let mut s = String::new();
        for (i, (k, v)) in self.fields.iter().enumerate() {
            if i > 0 {
                s.push(' ');
            }
            s.push_str(k);
            s.push('=');
            s.push_str(v);
        }
        s.push('\n');
        s
    }
}

/// Longest line either side accepts; longer input is a protocol error, not an allocation.
pub const MAX_LINE: usize = 64 * 1024;

/// Parse one PMI line (without or with its newline). Malformed input is an error, never a panic.
pub fn parse_line(line: &str) -> Result<Line> {
    let line = line.strip_suffix('\n').unwrap_or(line);
    if line.len() > MAX_LINE {
        return Err(Error::from(ErrorDetail::Bootstrap(format!(
            "PMI line of {} bytes exceeds the {MAX_LINE}-byte limit",
            line.len()
        ))));
    }
    let mut fields = Vec::new();
    for tok in line.split_ascii_whitespace() {
        let Some((k, v)) = tok.split_once('=') else {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "malformed PMI line: token '{}' has no '='",
                truncate(tok)
            ))));
        };
        if k.is_empty() || k.bytes().any(|b| !(33..=126).contains(&b)) {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "malformed PMI line: bad key '{}'",
                truncate(k)
            ))));
        }
        fields.push((k.to_string(), v.to_string()));
    }
    if fields.is_empty() {
        return Err(Error::from(ErrorDetail::Bootstrap("empty PMI line".into())));
    }
    let l = Line { fields };
    if l.get("cmd").is_none() && l.get("mcmd").is_none() {
        return Err(Error::from(ErrorDetail::Bootstrap(format!(
            "malformed PMI line: no cmd= in '{}'",
            truncate(line)
        ))));
    }
    Ok(l)
}

fn truncate(s: &str) -> String {
    if s.len() <= 80 {
        s.to_string()
    } else {
        let mut end = 80;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &s[..end])
    }
}

/// Escape a value into PMI's safe character set.
pub fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if (33..=126).contains(&b) && b != b'=' && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Undo [`escape`].
pub fn unescape(v: &str) -> Result<String> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = v
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    Error::from(ErrorDetail::Bootstrap(format!(
                        "bad escape in PMI value '{}'",
                        truncate(v)
                    )))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| Error::from(ErrorDetail::Bootstrap("PMI value is not UTF-8".into())))
}

/// Split an escaped value into chunks that fit `max` bytes each, never splitting an escape.
pub fn split_value(escaped: &str, max: usize) -> Vec<&str> {
    let max = max.max(4);
    let mut parts = Vec::new();
    let mut rest = escaped;
    while rest.len() > max {
        let mut cut = max;
        // Do not cut inside a %XX escape.
        if let Some(p) = rest[..cut].rfind('%') {
            if p + 3 > cut {
                cut = p;
            }
        }
        parts.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    parts.push(rest);
    parts
}

enum Conn {
    Unix(BufReader<UnixStream>),
    Tcp(BufReader<std::net::TcpStream>),
}

impl Conn {
    fn send(&mut self, s: &str) -> std::io::Result<()> {
        match self {
            Conn::Unix(r) => r.get_mut().write_all(s.as_bytes()),
            Conn::Tcp(r) => r.get_mut().write_all(s.as_bytes()),
        }
    }

    fn recv(&mut self, buf: &mut String) -> std::io::Result<usize> {
        buf.clear();
        let r: &mut dyn BufRead = match self {
            Conn::Unix(r) => r,
            Conn::Tcp(r) => r,
        };
        // Bounded read: a peer cannot make us buffer more than MAX_LINE bytes.
        let n = std::io::Read::take(r, MAX_LINE as u64 + 1).read_line(buf)?;
        Ok(n)
    }

    fn set_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Conn::Unix(r) => r.get_ref().set_read_timeout(t),
            Conn::Tcp(r) => r.get_ref().set_read_timeout(t),
        }
    }
}

/// The connection to the PMI server and what the handshake learned.
struct Client {
    conn: Conn,
    rank: Rank,
    size: u32,
    kvsname: String,
    appnum: i64,
    key_max: usize,
    val_max: usize,
    timeout: Duration,
    finalized: bool,
    line: String,
}

/// A connected, initialised PMI-1 client. Its connection is shared with the key-value handles
/// providers keep after `open` ([`Bootstrap::kv`]).
pub struct Pmi {
    c: Arc<Mutex<Client>>,
    rank: Rank,
    size: u32,
    kvsname: String,
    nodes: NodeMap,
}

/// A provider's handle to the job's key-value space (see [`Bootstrap::kv`]).
struct PmiKv(Arc<Mutex<Client>>);

impl KvSpace for PmiKv {
    fn put(&self, key: &str, value: &str) -> Result<()> {
        lock(&self.0).put_value(key, value)
    }
    fn get(&self, key: &str) -> Result<Option<String>> {
        lock(&self.0).try_get_value(key)
    }
}

fn lock(c: &Mutex<Client>) -> std::sync::MutexGuard<'_, Client> {
    c.lock().unwrap_or_else(|e| e.into_inner())
}

impl std::fmt::Debug for Pmi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pmi")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("kvsname", &self.kvsname)
            .finish()
    }
}

fn env_u32(name: &str) -> Result<Option<u32>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => v.trim().parse().map(Some).map_err(|_| {
            Error::from(ErrorDetail::Param {
                var: name.into(),
                value: v,
                expected: "a non-negative integer".into(),
            })
        }),
    }
}

impl Pmi {
    /// Whether the environment names a PMI server.
    pub fn in_env() -> bool {
        std::env::var_os("PMI_FD").is_some() || std::env::var_os("PMI_PORT").is_some()
    }

    /// Connect to the server named by the environment and run the PMI-1 handshake, then build
    /// the node map. `timeout` bounds every wait on the server (a barrier waits for the slowest
    /// rank, so it is also how long a missing rank is tolerated).
    pub fn from_env(timeout: Duration) -> Result<Pmi> {
        let mut p = Self::from_env_unexchanged(timeout)?;
        p.exchange_nodes()?;
        Ok(p)
    }

    /// [`Self::from_env`] without its one collective step, the exchange of host identities
    /// for the node map: rank, size and job are known, but the node map is not until
    /// [`Self::exchange_nodes`] (every rank must call it, before the map is used). For a face
    /// of weft whose processes name themselves before they meet (libfabric's `fi_getname`).
    pub fn from_env_unexchanged(timeout: Duration) -> Result<Pmi> {
        let rank = env_u32("PMI_RANK")?;
        let size = env_u32("PMI_SIZE")?;
        if let Some(fd) = env_u32("PMI_FD")? {
            let fd = fd as i32;
            // SAFETY: fcntl(F_GETFD) only inspects the descriptor.
            if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(Error::from(ErrorDetail::Bootstrap(format!(
                    "PMI_FD={fd} is not an open file descriptor"
                ))));
            }
            // SAFETY: the launcher passes this descriptor to us for our exclusive use as the PMI
            // connection, and nothing else in the process owns or closes it; ownership moves
            // into the UnixStream.
            let s = unsafe { UnixStream::from_raw_fd(fd) };
            let rank = rank
                .ok_or_else(|| Error::from(ErrorDetail::Bootstrap("PMI_RANK is not set".into())))?;
            let size = size
                .ok_or_else(|| Error::from(ErrorDetail::Bootstrap("PMI_SIZE is not set".into())))?;
            return Self::handshake(
                Conn::Unix(BufReader::new(s)),
                Some((rank, size)),
                None,
                timeout,
            );
        }
        if let Ok(port) = std::env::var("PMI_PORT") {
            let s = std::net::TcpStream::connect(port.trim())
                .map_err(|e| Error::io(format!("connecting to PMI_PORT {port}"), e))?;
            s.set_nodelay(true).ok();
            let id = std::env::var("PMI_ID").ok().map(|v| v.trim().to_string());
            let known = match (rank, size) {
                (Some(r), Some(n)) if id.is_none() => Some((r, n)),
                _ => None,
            };
            return Self::handshake(Conn::Tcp(BufReader::new(s)), known, id, timeout);
        }
        Err(Error::from(ErrorDetail::Bootstrap(
            "no PMI_FD or PMI_PORT in the environment".into(),
        )))
    }

    /// Run the PMI-1 handshake over an already connected socket (what `PMI_FD` names).
    pub fn over_socket(s: UnixStream, rank: Rank, size: u32, timeout: Duration) -> Result<Pmi> {
        let mut p = Self::handshake(
            Conn::Unix(BufReader::new(s)),
            Some((rank, size)),
            None,
            timeout,
        )?;
        p.exchange_nodes()?;
        Ok(p)
    }

    fn handshake(
        mut conn: Conn,
        known: Option<(Rank, u32)>,
        pmi_id: Option<String>,
        timeout: Duration,
    ) -> Result<Pmi> {
        conn.set_timeout(Some(timeout))
            .map_err(|e| Error::io("setting the PMI socket timeout", e))?;
        let (mut rank, mut size) = match known {
            Some((r, n)) => (Some(r), Some(n)),
            None => (None, None),
        };
        let mut p = Client {
            conn,
            rank: rank.unwrap_or(0),
            size: size.unwrap_or(1),
            kvsname: String::new(),
            appnum: 0,
            key_max: 64,
            val_max: 256,
            timeout,
            finalized: false,
            line: String::new(),
        };
        // PMI_PORT mode identifies itself with PMI_ID and learns rank and size from `cmd=set`.
        if let Some(id) = pmi_id {
            p.send(&format!("cmd=initack pmiid={id}\n"))?;
            let l = p.recv("initack")?;
            if l.cmd() != "initack" || l.rc()? != 0 {
                return Err(Error::from(ErrorDetail::Bootstrap(format!(
                    "the PMI server refused id {id}: {}",
                    l.get("msg").unwrap_or("no reason given")
                ))));
            }
            for _ in 0..3 {
                let l = p.recv("set")?;
                if l.cmd() != "set" {
                    return Err(Error::from(ErrorDetail::Bootstrap(format!(
                        "expected cmd=set, got cmd={}",
                        l.cmd()
                    ))));
                }
                if let Some(v) = l.get("size") {
                    size = v.parse().ok();
                }
                if let Some(v) = l.get("rank") {
                    rank = v.parse().ok();
                }
            }
        }
        p.rank =
            rank.ok_or_else(|| Error::from(ErrorDetail::Bootstrap("PMI rank is unknown".into())))?;
        p.size =
            size.ok_or_else(|| Error::from(ErrorDetail::Bootstrap("PMI size is unknown".into())))?;
        if p.size == 0 || p.rank >= p.size {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "PMI rank {} is outside a job of size {}",
                p.rank, p.size
            ))));
        }
        let r = p.call(
            "cmd=init pmi_version=1 pmi_subversion=1\n",
            "response_to_init",
        )?;
        if r.get("pmi_version").is_some_and(|v| v != "1") {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "server speaks PMI version {}, weft speaks 1",
                r.get("pmi_version").unwrap_or("?")
            ))));
        }
        let r = p.call("cmd=get_maxes\n", "maxes")?;
        let num = |k: &str, d: usize| r.get(k).and_then(|v| v.parse().ok()).unwrap_or(d);
        // The maxima include the terminating NUL of the C API.
        p.key_max = num("keylen_max", 64).saturating_sub(1).max(8);
        p.val_max = num("vallen_max", 256).saturating_sub(1).max(16);
        let r = p.call("cmd=get_appnum\n", "appnum")?;
        p.appnum = r.get("appnum").and_then(|v| v.parse().ok()).unwrap_or(0);
        let r = p.call("cmd=get_my_kvsname\n", "my_kvsname")?;
        p.kvsname = r
            .get("kvsname")
            .ok_or_else(|| {
                Error::from(ErrorDetail::Bootstrap(
                    "my_kvsname response has no kvsname".into(),
                ))
            })?
            .to_string();
        let pmi = Pmi {
            rank: p.rank,
            size: p.size,
            kvsname: p.kvsname.clone(),
            c: Arc::new(Mutex::new(p)),
            nodes: NodeMap::single_host(1),
        };
        Ok(pmi)
    }

    /// The node map: everybody publishes its host identity (collective).
    pub fn exchange_nodes(&mut self) -> Result<()> {
        let ids = super::allgather(self, "weft.host", &host_id())?;
        self.nodes = NodeMap::from_ids(&ids, self.rank);
        Ok(())
    }

    pub fn appnum(&self) -> i64 {
        lock(&self.c).appnum
    }

    /// Server limits (key, value) after subtracting the C API's NUL.
    pub fn maxes(&self) -> (usize, usize) {
        let c = lock(&self.c);
        (c.key_max, c.val_max)
    }

    /// Tell the launcher to end the job.
    pub fn abort_job(&mut self, code: i32, msg: &str) {
        lock(&self.c).abort_job(code, msg)
    }
}

impl Client {
    fn send(&mut self, s: &str) -> Result<()> {
        self.conn
            .send(s)
            .map_err(|e| Error::io("writing to the PMI server", e))
    }

    fn recv(&mut self, what: &str) -> Result<Line> {
        let mut buf = std::mem::take(&mut self.line);
        let r = self.conn.recv(&mut buf);
        let out = match r {
            Ok(0) => Err(Error::from(ErrorDetail::Bootstrap(format!(
                "the PMI server closed the connection while rank {} waited for {what}",
                self.rank
            )))),
            Ok(n) if n > MAX_LINE => Err(Error::from(ErrorDetail::Bootstrap(format!(
                "PMI response longer than {MAX_LINE} bytes"
            )))),
            Ok(_) if !buf.ends_with('\n') => Err(Error::from(ErrorDetail::Bootstrap(format!(
                "the PMI server closed the connection mid-line while rank {} waited for {what}",
                self.rank
            )))),
            Ok(_) => parse_line(&buf),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                Err(Error::from(ErrorDetail::Timeout {
                    what: format!("the PMI server ({what}); is a rank missing?"),
                    secs: self.timeout.as_secs_f64(),
                }))
            }
            Err(e) => Err(Error::io(format!("reading the PMI {what} response"), e)),
        };
        self.line = buf;
        out
    }

    /// Send a request and read the response, which must be `cmd=<expect>` with rc 0.
    fn call(&mut self, req: &str, expect: &str) -> Result<Line> {
        self.send(req)?;
        let l = self.recv(expect)?;
        if l.cmd() != expect {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "expected cmd={expect} from the PMI server, got cmd={}",
                l.cmd()
            ))));
        }
        if l.rc()? != 0 {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "PMI {expect} failed: rc={} {}",
                l.rc()?,
                l.get("msg").unwrap_or("")
            ))));
        }
        Ok(l)
    }

    fn check_key(&self, key: &str) -> Result<()> {
        if key.is_empty()
            || key.len() > self.key_max
            || key.bytes().any(|b| !(33..=126).contains(&b) || b == b'=')
        {
            return Err(Error::invalid(format!(
                "PMI key '{key}' is empty, has spaces or '=', or is longer than the server's {} bytes",
                self.key_max
            )));
        }
        Ok(())
    }

    fn raw_put(&mut self, key: &str, value: &str) -> Result<()> {
        self.check_key(key)?;
        let req = format!("cmd=put kvsname={} key={key} value={value}\n", self.kvsname);
        self.call(&req, "put_result").map(|_| ())
    }

    /// The raw value of `key`; `None` if the server has none.
    fn raw_get(&mut self, key: &str) -> Result<Option<String>> {
        self.check_key(key)?;
        let req = format!("cmd=get kvsname={} key={key}\n", self.kvsname);
        self.send(&req)?;
        let l = self.recv("get_result")?;
        if l.cmd() != "get_result" {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "expected cmd=get_result, got cmd={}",
                l.cmd()
            ))));
        }
        if l.rc()? != 0 {
            return Ok(None);
        }
        Ok(Some(l.get("value").unwrap_or("").to_string()))
    }

    /// Tell the launcher to end the job.
    pub fn abort_job(&mut self, code: i32, msg: &str) {
        // Say why before the launcher's reaction to the abort can kill this process: a
        // launcher need not print the message (Hydra does not), and an error returned to the
        // program after this call may never be printed.
        eprintln!(
            "weft: rank {} aborts the job (exit code {code}): {msg}",
            self.rank
        );
        let _ = self.send(&format!(
            "cmd=abort exitcode={code} error_msg={}\n",
            escape(msg)
        ));
    }

    pub(super) fn put_value(&mut self, key: &str, value: &str) -> Result<()> {
        let esc = escape(value);
        // One-part values are stored as "1" + data; longer ones as "<n>" + first part with the
        // others under "<key>~<i>". The part count precedes a ':'.
        let room = self.val_max.saturating_sub(8);
        let parts = split_value(&esc, room);
        if parts.len() == 1 {
            return self.raw_put(key, &format!("1:{}", parts[0]));
        }
        let n = parts.len();
        let owned: Vec<String> = parts.iter().map(|s| s.to_string()).collect();
        for (i, p) in owned.iter().enumerate().skip(1) {
            self.raw_put(&format!("{key}~{i}"), p)?;
        }
        self.raw_put(key, &format!("{n}:{}", owned[0]))
    }
    pub(super) fn get_value(&mut self, key: &str) -> Result<String> {
        self.try_get_value(key)?.ok_or_else(|| {
            Error::from(ErrorDetail::Bootstrap(format!("PMI key '{key}' not found")))
        })
    }

    /// A value published with `put_value`; `None` if `key` was never published.
    pub(super) fn try_get_value(&mut self, key: &str) -> Result<Option<String>> {
        let Some(head) = self.raw_get(key)? else {
            return Ok(None);
        };
        let (n, first) = head
            .split_once(':')
            .and_then(|(n, rest)| n.parse::<usize>().ok().map(|n| (n, rest)))
            .ok_or_else(|| {
                Error::from(ErrorDetail::Bootstrap(format!(
                    "PMI value of '{key}' is not weft's"
                )))
            })?;
        if n == 0 || n > 1 << 16 {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "PMI value of '{key}' claims {n} parts"
            ))));
        }
        let mut esc = first.to_string();
        for i in 1..n {
            let part = self.raw_get(&format!("{key}~{i}"))?.ok_or_else(|| {
                Error::from(ErrorDetail::Bootstrap(format!(
                    "PMI value of '{key}' lacks part {i}"
                )))
            })?;
            esc.push_str(&part);
        }
        unescape(&esc).map(Some)
    }
}

impl Bootstrap for Pmi {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn size(&self) -> u32 {
        self.size
    }
    fn job_id(&self) -> &str {
        &self.kvsname
    }
    fn put(&mut self, key: &str, value: &str) -> Result<()> {
        lock(&self.c).put_value(key, value)
    }
    fn fence(&mut self) -> Result<()> {
        lock(&self.c)
            .call("cmd=barrier_in\n", "barrier_out")
            .map(|_| ())
    }
    fn get(&mut self, key: &str) -> Result<String> {
        lock(&self.c).get_value(key)
    }
    fn nodes(&self) -> &NodeMap {
        &self.nodes
    }
    fn kv(&self) -> Option<Arc<dyn KvSpace>> {
        Some(Arc::new(PmiKv(self.c.clone())))
    }
    fn abort(&mut self, code: i32, msg: &str) {
        self.abort_job(code, msg);
    }
    fn finalize(&mut self) -> Result<()> {
        let mut c = lock(&self.c);
        if c.finalized {
            return Ok(());
        }
        c.finalized = true;
        c.call("cmd=finalize\n", "finalize_ack").map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_responses() {
        let l = parse_line("cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024\n").unwrap();
        assert_eq!(l.cmd(), "maxes");
        assert_eq!(l.get("vallen_max"), Some("1024"));
        assert_eq!(l.rc().unwrap(), 0);
        let l = parse_line("cmd=get_result rc=-1 msg=key_not_found").unwrap();
        assert_eq!(l.rc().unwrap(), -1);
        assert_eq!(parse_line(&l.to_wire()).unwrap(), l);
    }

    #[test]
    fn malformed_lines_are_errors() {
        for bad in [
            "",
            "\n",
            "cmd",
            "cmd=put oops",
            "key=v",
            "=v cmd=x",
            "cmd=x a==b c",
        ] {
            assert!(parse_line(bad).is_err(), "{bad:?} parsed");
        }
        assert!(parse_line(&"x".repeat(MAX_LINE + 10)).is_err());
    }

    #[test]
    fn escape_roundtrip_and_split() {
        let v = "tcp://10.0.0.1:4000 a=b 100%\u{e9}";
        let e = escape(v);
        assert!(e.bytes().all(|b| (33..=126).contains(&b) && b != b'='));
        assert_eq!(unescape(&e).unwrap(), v);
        let parts = split_value(&e, 5);
        assert!(parts.iter().all(|p| p.len() <= 5));
        assert_eq!(parts.concat(), e);
        for p in &parts {
            // No part ends in the middle of an escape.
            assert!(unescape(p).is_ok() || p.contains('%'));
        }
        assert!(unescape("%G1").is_err());
        assert!(unescape("%4").is_err());
    }

    /// A scripted PMI server on the other end of a socketpair: answers each request with the
    /// next scripted reply; `None` closes the connection.
    fn fake_server(script: Vec<Option<&'static str>>) -> (UnixStream, std::thread::JoinHandle<()>) {
        let (a, b) = UnixStream::pair().unwrap();
        let h = std::thread::spawn(move || {
            let mut rd = BufReader::new(b);
            for step in script {
                let mut l = String::new();
                if rd.read_line(&mut l).unwrap_or(0) == 0 {
                    return;
                }
                match step {
                    Some(reply) => {
                        if rd.get_mut().write_all(reply.as_bytes()).is_err() {
                            return;
                        }
                    }
                    None => return,
                }
            }
            // Stay silent, socket open, until the client gives up.
            let mut l = String::new();
            while rd.read_line(&mut l).unwrap_or(0) > 0 {
                l.clear();
            }
        });
        (a, h)
    }

    const HELLO: [Option<&str>; 4] = [
        Some("cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1\n"),
        Some("cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024\n"),
        Some("cmd=appnum rc=0 appnum=0\n"),
        Some("cmd=my_kvsname rc=0 kvsname=kvs_1\n"),
    ];

    #[test]
    fn singleton_job_over_a_fake_server() {
        let mut script = HELLO.to_vec();
        script.push(Some("cmd=put_result rc=0\n"));
        script.push(Some("cmd=barrier_out rc=0\n"));
        let (s, h) = fake_server(script);
        let p = Pmi::over_socket(s, 0, 1, Duration::from_secs(10)).unwrap();
        assert_eq!(p.job_id(), "kvs_1");
        assert_eq!(p.maxes(), (63, 1023));
        drop(p);
        h.join().unwrap();
    }

    #[test]
    fn server_closing_early_is_an_error() {
        let (s, h) = fake_server(vec![Some(HELLO[0].unwrap()), None]);
        let e = Pmi::over_socket(s, 0, 2, Duration::from_secs(10)).unwrap_err();
        assert!(e.to_string().contains("closed the connection"), "{e}");
        h.join().unwrap();
    }

    #[test]
    fn missing_rank_times_out_in_the_barrier() {
        let mut script = HELLO.to_vec();
        script.push(Some("cmd=put_result rc=0\n"));
        // ... and barrier_out never comes.
        let (s, h) = fake_server(script);
        let t0 = std::time::Instant::now();
        let e = Pmi::over_socket(s, 0, 2, Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Timeout, "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        h.join().unwrap();
    }

    #[test]
    fn malformed_response_is_an_error() {
        let (s, h) = fake_server(vec![Some("this is not pmi\n")]);
        let e = Pmi::over_socket(s, 0, 1, Duration::from_secs(10)).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Bootstrap, "{e}");
        h.join().unwrap();
    }

    #[test]
    fn long_values_are_split_and_joined() {
        // A server with a 32-byte value limit; the client splits a 200-byte value.
        use std::collections::HashMap;
        let (a, b) = UnixStream::pair().unwrap();
        let h = std::thread::spawn(move || {
            let mut rd = BufReader::new(b);
            let mut kv: HashMap<String, String> = HashMap::new();
            loop {
                let mut l = String::new();
                if rd.read_line(&mut l).unwrap_or(0) == 0 {
                    return;
                }
                let req = parse_line(&l).unwrap();
                let reply = match req.cmd() {
                    "init" => HELLO[0].unwrap().to_string(),
                    "get_maxes" => {
                        "cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=32\n".into()
                    }
                    "get_appnum" => HELLO[2].unwrap().to_string(),
                    "get_my_kvsname" => HELLO[3].unwrap().to_string(),
                    "barrier_in" => "cmd=barrier_out rc=0\n".into(),
                    "put" => {
                        let v = req.get("value").unwrap().to_string();
                        assert!(v.len() < 32, "value of {} bytes sent", v.len());
                        kv.insert(req.get("key").unwrap().into(), v);
                        "cmd=put_result rc=0\n".into()
                    }
                    "get" => match kv.get(req.get("key").unwrap()) {
                        Some(v) => format!("cmd=get_result rc=0 value={v}\n"),
                        None => "cmd=get_result rc=-1 msg=key_not_found\n".into(),
                    },
                    _ => "cmd=unknown rc=-1\n".into(),
                };
                rd.get_mut().write_all(reply.as_bytes()).unwrap();
            }
        });
        let mut p = Pmi::over_socket(a, 0, 1, Duration::from_secs(10)).unwrap();
        let long: String = (0..200)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let long = format!("{long} with spaces = and %");
        p.put("addr", &long).unwrap();
        p.fence().unwrap();
        assert_eq!(p.get("addr").unwrap(), long);
        assert!(p.get("nothing").is_err());
        drop(p);
        h.join().unwrap();
    }

    proptest! {
        #[test]
        fn parser_never_panics(s in ".{0,200}") {
            let _ = parse_line(&s);
        }

        #[test]
        fn wellformed_lines_roundtrip(
            cmd in "[a-z_]{1,12}",
            kv in proptest::collection::vec(("[a-z_]{1,8}", "[!-<>-~]{0,12}"), 0..6)
        ) {
            let mut fields = vec![("cmd".to_string(), cmd)];
            fields.extend(kv);
            let l = Line { fields };
            prop_assert_eq!(parse_line(&l.to_wire()).unwrap(), l);
        }

        #[test]
        fn escape_split_join_is_identity(v in "\\PC{0,300}", max in 4usize..40) {
            let e = escape(&v);
            let parts = split_value(&e, max);
            for p in &parts {
                prop_assert!(p.len() <= max.max(4));
            }
            prop_assert_eq!(unescape(&parts.concat()).unwrap(), v);
        }
    }
}
