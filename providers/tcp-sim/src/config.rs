//! tcp-sim's configuration: its parameters (`WEFT_TCP_SIM_*`), the interface or address to
//! bind, and the simulated network's settings.

use super::*;

weft_provider::param!(pub(crate) BIND: Str = "tcp-sim", "BIND", "auto",
    "address or interface to listen on (auto: loopback when every rank is on this host, else the first non-loopback IPv4 address)");
weft_provider::param!(pub(crate) CHUNK: Size[4 << 10, 64 << 20] = "tcp-sim", "CHUNK", "512K",
    "largest frame payload: the rendezvous chunk size (4K to 64M)");
weft_provider::param!(pub(crate) EAGER: Size = "tcp-sim", "EAGER", "64K",
    "messages up to this size are sent eagerly");
weft_provider::param!(pub(crate) DIRECT: Bool = "tcp-sim", "DIRECT", "1",
    "read large payloads from the socket straight into the receive buffer when the core names it (0: always through the connection's buffer)");
weft_provider::param!(pub(crate) QUEUE: Size[0, 1 << 30] = "tcp-sim", "QUEUE", "1M",
    "unsent bytes a connection may buffer before senders see Busy (at least two frames; simulating, plus the bytes on the simulated wire; at most 1G)");
weft_provider::param!(pub(crate) DELAY_US: Uint[0, 1_000_000] = "tcp-sim", "DELAY_US", "0",
    "simulated one-way delay added to every frame, in microseconds (at most 10^6)");
weft_provider::param!(pub(crate) BW_MBPS: Float[0, 1e7] check(weft_provider::param::checks::zero_or_a_rate) = "tcp-sim", "BW_MBPS", "0",
    "simulated bandwidth per rank in MB/s (10^6 B/s; 0: unlimited, else 0.001 to 10^7)");
weft_provider::param!(pub(crate) JITTER_US: Uint[0, 1_000_000] = "tcp-sim", "JITTER_US", "0",
    "simulated random extra delay per frame, uniform in [0, JITTER_US] microseconds (at most 10^6)");

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) bind: String,
    pub(crate) chunk: usize,
    pub(crate) eager: usize,
    pub(crate) direct: bool,
    pub(crate) queue: usize,
    pub(crate) delay: Duration,
    pub(crate) jitter: Duration,
    pub(crate) rate: Option<f64>,
}

impl Config {
    pub(crate) fn from_env() -> Result<Config> {
        // Every range is in the parameter's declaration.
        let chunk = CHUNK.get_size()?;
        let bw = BW_MBPS.get_f64()?;
        let micros = |p: &weft_provider::param::ParamDesc| -> Result<Duration> {
            Ok(Duration::from_micros(p.get_u64()?))
        };
        let queue = QUEUE.get_size()?;
        Ok(Config {
            bind: BIND.get_str(),
            chunk,
            eager: EAGER.get_size()?.min(chunk),
            direct: DIRECT.get_bool()?,
            // At least two whole frames: when simulating, one is being serialised through the
            // token bucket while the next waits (with one, the link idles between frames).
            queue: queue.max(2 * (FRAME_HDR + MAX_HEADER + chunk)),
            delay: micros(&DELAY_US)?,
            jitter: micros(&JITTER_US)?,
            rate: (bw > 0.0).then_some(bw * 1e6),
        })
    }

    pub(crate) fn caps(&self) -> Caps {
        let mut c = Caps::am_only(MAX_HEADER, self.chunk, 64);
        c.eager_limit = self.eager;
        c.spans_processes = true;
        c.spans_hosts = true;
        c
    }

    pub(crate) fn simulating(&self) -> bool {
        !self.delay.is_zero() || !self.jitter.is_zero() || self.rate.is_some()
    }
}

/// First IPv4 address of an up, non-loopback interface (or of the named interface).
pub(crate) fn interface_addr(name: Option<&str>) -> Option<Ipv4Addr> {
    let mut found = None;
    // SAFETY: getifaddrs allocates a list we walk read-only and free with freeifaddrs.
    unsafe {
        let mut ifs: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut ifs) != 0 {
            return None;
        }
        let mut p = ifs;
        while !p.is_null() {
            let ifa = &*p;
            p = ifa.ifa_next;
            if ifa.ifa_addr.is_null() || (*ifa.ifa_addr).sa_family as i32 != libc::AF_INET {
                continue;
            }
            let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
            let lo = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
            let ifname = std::ffi::CStr::from_ptr(ifa.ifa_name).to_string_lossy();
            let wanted = match name {
                Some(n) => ifname == n,
                None => up && !lo,
            };
            if wanted {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
                break;
            }
        }
        libc::freeifaddrs(ifs);
    }
    found
}

pub(crate) fn bind_ip(spec: &str, one_host: bool) -> Result<IpAddr> {
    let s = spec.trim();
    if s.is_empty() || s == "auto" {
        if one_host {
            return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        return interface_addr(None).map(IpAddr::V4).ok_or_else(|| {
            Error::from(ErrorDetail::Unsupported(
                "no up, non-loopback IPv4 interface to listen on; set WEFT_TCP_SIM_BIND".into(),
            ))
        });
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(ip);
    }
    interface_addr(Some(s)).map(IpAddr::V4).ok_or_else(|| {
        Error::from(ErrorDetail::Param {
            var: BIND.env_name(),
            value: s.into(),
            expected: "auto, an IP address or an interface with an IPv4 address".into(),
        })
    })
}
