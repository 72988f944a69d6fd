//! The benchmark tests and the size-list syntax.

/// A benchmark test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Test {
    Latency,
    Bw,
    Bibw,
    Mr,
    Alltoall,
    Halo,
    Sparse,
    Mixed,
    Mem,
    PutLat,
    PutPollLat,
    GetLat,
    AccLat,
    PutBw,
    GetBw,
    EpochMix,
    EpochPingpong,
    VerbsSendLat,
    VerbsWriteLat,
    VerbsWriteLatDm,
    VerbsReadLat,
    VerbsAtomicLat,
    VerbsWriteBw,
    VerbsSendBw,
    CmaWriteLat,
    CmaWriteBw,
}

/// Every test name the command knows, with what it measures.
pub const ALL: &[(&str, &str)] = &[
    ("latency", "ping-pong, one-way latency in µs"),
    ("bw", "windowed streaming bandwidth in MB/s (10^6 B/s)"),
    (
        "bibw",
        "bidirectional windowed bandwidth in MB/s (both directions)",
    ),
    ("mr", "windowed message rate in messages/s"),
    (
        "alltoall",
        "time of one alltoall with SIZE bytes per pair, µs (slowest rank)",
    ),
    (
        "halo",
        "one exchange step with the 4 nearest ranks on a ring (r±1, r±2), SIZE bytes each way; µs per step (slowest rank); where RC channels pay",
    ),
    (
        "sparse",
        "one exchange step with up to 16 ranks spread over the job, SIZE bytes each way; µs per step (slowest rank); where UD pays",
    ),
    (
        "mixed",
        "one step of halo with SIZE bytes and sparse with 64 bytes; µs per step (slowest rank)",
    ),
    (
        "mem",
        "memory per process for communication after every pair exchanged SIZE-byte messages (HCA structures, buffers, peer tables; the provider's mem_* counters), KiB (largest rank)",
    ),
    (
        "put_lat",
        "RMA ping-pong, one put per access epoch then an exposure epoch; half the iteration, µs",
    ),
    (
        "put_poll_lat",
        "RMA ping-pong as ucx_perftest's ucp_put_lat: passive target on an allocated window, put + flush, the target polls its memory for the last byte, then answers; half the round trip, µs",
    ),
    (
        "get_lat",
        "RMA ping-pong with one get per access epoch; half the iteration, µs",
    ),
    (
        "acc_lat",
        "RMA ping-pong with one accumulate (sum, u64) per access epoch; half the iteration, µs",
    ),
    (
        "put_bw",
        "puts of SIZE bytes, a window of W per fence epoch, MB/s",
    ),
    (
        "get_bw",
        "gets of SIZE bytes, a window of W per fence epoch, MB/s",
    ),
    (
        "epoch_mix",
        "16 puts and 16 gets of SIZE bytes per fence epoch; bytes moved, MB/s",
    ),
    (
        "epoch_pingpong",
        "RMA ping-pong, one put and one get per access epoch; half the iteration, µs",
    ),
    (
        "verbs_send_lat",
        "raw verbs (WEFT_VERBS_DEVICE): RC send/receive ping-pong, half the round trip, µs (perftest ib_send_lat)",
    ),
    (
        "verbs_write_lat",
        "raw verbs: RDMA-write ping-pong into user memory, each side polls the last byte; half the round trip, µs (ib_write_lat)",
    ),
    (
        "verbs_write_lat_dm",
        "raw verbs: as verbs_write_lat, into device memory (alloc_dm), µs",
    ),
    (
        "verbs_read_lat",
        "raw verbs: one RDMA read, the full round trip, µs (ib_read_lat)",
    ),
    (
        "verbs_atomic_lat",
        "raw verbs: one 8-byte fetch-and-add, the full round trip, µs (ib_atomic_lat)",
    ),
    (
        "verbs_write_bw",
        "raw verbs: a window of W RDMA writes, the last signaled, MB/s (ib_write_bw)",
    ),
    (
        "verbs_send_bw",
        "raw verbs: a window of W sends into posted receives, MB/s (ib_send_bw)",
    ),
    (
        "cma_write_lat",
        "reference: process_vm_writev ping-pong, each side polls the last byte; half the round trip, µs",
    ),
    (
        "cma_write_bw",
        "reference: process_vm_writev of SIZE bytes into the peer, back to back, MB/s",
    ),
];

impl Test {
    pub fn parse(s: &str) -> Result<Test, String> {
        Ok(match s.trim() {
            "latency" | "lat" => Test::Latency,
            "bw" => Test::Bw,
            "bibw" => Test::Bibw,
            "mr" => Test::Mr,
            "alltoall" => Test::Alltoall,
            "halo" => Test::Halo,
            "sparse" => Test::Sparse,
            "mixed" => Test::Mixed,
            "mem" => Test::Mem,
            "put_lat" => Test::PutLat,
            "put_poll_lat" => Test::PutPollLat,
            "get_lat" => Test::GetLat,
            "acc_lat" => Test::AccLat,
            "put_bw" => Test::PutBw,
            "get_bw" => Test::GetBw,
            "epoch_mix" => Test::EpochMix,
            "epoch_pingpong" => Test::EpochPingpong,
            "verbs_send_lat" => Test::VerbsSendLat,
            "verbs_write_lat" => Test::VerbsWriteLat,
            "verbs_write_lat_dm" => Test::VerbsWriteLatDm,
            "verbs_read_lat" => Test::VerbsReadLat,
            "verbs_atomic_lat" => Test::VerbsAtomicLat,
            "verbs_write_bw" => Test::VerbsWriteBw,
            "verbs_send_bw" => Test::VerbsSendBw,
            "cma_write_lat" => Test::CmaWriteLat,
            "cma_write_bw" => Test::CmaWriteBw,
            other => {
                return Err(format!(
                    "unknown test '{other}'; tests: {}",
                    ALL.iter().map(|t| t.0).collect::<Vec<_>>().join(", ")
                ))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Test::Latency => "latency",
            Test::Bw => "bw",
            Test::Bibw => "bibw",
            Test::Mr => "mr",
            Test::Alltoall => "alltoall",
            Test::Halo => "halo",
            Test::Sparse => "sparse",
            Test::Mixed => "mixed",
            Test::Mem => "mem",
            Test::PutLat => "put_lat",
            Test::PutPollLat => "put_poll_lat",
            Test::GetLat => "get_lat",
            Test::AccLat => "acc_lat",
            Test::PutBw => "put_bw",
            Test::GetBw => "get_bw",
            Test::EpochMix => "epoch_mix",
            Test::EpochPingpong => "epoch_pingpong",
            Test::VerbsSendLat => "verbs_send_lat",
            Test::VerbsWriteLat => "verbs_write_lat",
            Test::VerbsWriteLatDm => "verbs_write_lat_dm",
            Test::VerbsReadLat => "verbs_read_lat",
            Test::VerbsAtomicLat => "verbs_atomic_lat",
            Test::VerbsWriteBw => "verbs_write_bw",
            Test::VerbsSendBw => "verbs_send_bw",
            Test::CmaWriteLat => "cma_write_lat",
            Test::CmaWriteBw => "cma_write_bw",
        }
    }

    pub fn unit(self) -> &'static str {
        match self {
            Test::Latency
            | Test::Alltoall
            | Test::Halo
            | Test::Sparse
            | Test::Mixed
            | Test::PutLat
            | Test::PutPollLat
            | Test::GetLat
            | Test::AccLat
            | Test::EpochPingpong => "us",
            Test::Bw | Test::Bibw | Test::PutBw | Test::GetBw | Test::EpochMix => "MB/s",
            Test::VerbsWriteBw | Test::VerbsSendBw | Test::CmaWriteBw => "MB/s",
            Test::VerbsSendLat
            | Test::VerbsWriteLat
            | Test::VerbsWriteLatDm
            | Test::VerbsReadLat
            | Test::VerbsAtomicLat
            | Test::CmaWriteLat => "us",
            Test::Mr => "msg/s",
            Test::Mem => "KiB",
        }
    }

    pub fn describe(self) -> &'static str {
        ALL.iter()
            .find(|t| t.0 == self.name())
            .map(|t| t.1)
            .unwrap_or("")
    }

    pub fn higher_is_better(self) -> bool {
        matches!(
            self,
            Test::Bw
                | Test::Bibw
                | Test::Mr
                | Test::PutBw
                | Test::GetBw
                | Test::EpochMix
                | Test::VerbsWriteBw
                | Test::VerbsSendBw
                | Test::CmaWriteBw
        )
    }

    /// Raw verbs and their Cross-Memory Attach reference: run on the HCA, the job's provider
    /// only carries the set-up exchange.
    pub fn is_verbs(self) -> bool {
        matches!(
            self,
            Test::VerbsSendLat
                | Test::VerbsWriteLat
                | Test::VerbsWriteLatDm
                | Test::VerbsReadLat
                | Test::VerbsAtomicLat
                | Test::VerbsWriteBw
                | Test::VerbsSendBw
                | Test::CmaWriteLat
                | Test::CmaWriteBw
        )
    }

    pub fn min_ranks(self) -> u32 {
        match self {
            Test::Halo | Test::Sparse | Test::Mixed => 3,
            _ => 2,
        }
    }

    pub fn default_sizes(self) -> Vec<usize> {
        match self {
            Test::Latency => vec![0, 8, 64, 512, 4096, 32768, 262144],
            Test::Bw | Test::Bibw => vec![
                1 << 10,
                1 << 13,
                1 << 16,
                1 << 18,
                1 << 20,
                1 << 22,
                1 << 24,
            ],
            Test::Mr => vec![1, 8, 64, 512, 4096],
            Test::Alltoall => vec![8, 512, 4096, 65536],
            Test::Halo => vec![2048, 8192, 65536],
            Test::Sparse => vec![8, 256, 1024],
            Test::Mixed => vec![4096, 32768],
            Test::Mem => vec![8, 65536],
            Test::PutLat | Test::PutPollLat | Test::GetLat | Test::EpochPingpong => {
                vec![8, 64, 256, 4096, 65536]
            }
            Test::AccLat => vec![8, 64, 256, 4096],
            Test::PutBw | Test::GetBw => vec![1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20],
            Test::EpochMix => vec![8, 64, 256, 4096, 65536],
            Test::VerbsSendLat
            | Test::VerbsWriteLat
            | Test::VerbsWriteLatDm
            | Test::VerbsReadLat
            | Test::CmaWriteLat => vec![8, 64, 1024, 4096, 65536],
            Test::VerbsAtomicLat => vec![8],
            Test::VerbsWriteBw | Test::VerbsSendBw | Test::CmaWriteBw => {
                vec![1 << 12, 1 << 16, 1 << 20, 1 << 22]
            }
        }
    }

    /// Default iteration count for small messages (large ones are scaled down).
    pub fn default_iters(self) -> usize {
        match self {
            Test::Latency => 20_000,
            Test::Bw | Test::Bibw | Test::Mr => 200,
            Test::Alltoall | Test::Halo | Test::Sparse | Test::Mixed => 1000,
            Test::Mem => 20,
            Test::PutLat | Test::GetLat | Test::AccLat | Test::EpochPingpong => 5000,
            Test::PutPollLat => 20_000,
            Test::PutBw | Test::GetBw | Test::EpochMix => 500,
            Test::VerbsSendLat
            | Test::VerbsWriteLat
            | Test::VerbsWriteLatDm
            | Test::VerbsReadLat
            | Test::VerbsAtomicLat
            | Test::CmaWriteLat => 20_000,
            Test::VerbsWriteBw | Test::VerbsSendBw | Test::CmaWriteBw => 200,
        }
    }
}

/// Parse `LIST` (`8,64,4K`) or `MIN:MAX` (powers of two from MIN to MAX inclusive; MIN may be
/// 0, which adds 0 and starts the doubling at 1).
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty size list".into());
    }
    let one = |x: &str| {
        weft::param::parse_size(x).ok_or_else(|| format!("'{x}' is not a size (e.g. 8, 64K, 1M)"))
    };
    let mut v = if let Some((a, b)) = s.split_once(':') {
        let (lo, hi) = (one(a)?, one(b)?);
        if lo > hi {
            return Err(format!("size range {s} is empty (MIN > MAX)"));
        }
        if hi > 1 << 30 {
            return Err("sizes above 1G are not supported".into());
        }
        let mut v = vec![];
        if lo == 0 {
            v.push(0);
        }
        let mut x = lo.max(1).next_power_of_two();
        if lo > 0 && !lo.is_power_of_two() {
            v.push(lo);
        }
        while x <= hi {
            v.push(x);
            x *= 2;
        }
        v
    } else {
        s.split(',').map(one).collect::<Result<Vec<_>, _>>()?
    };
    if v.iter().any(|x| *x > 1 << 30) {
        return Err("sizes above 1G are not supported".into());
    }
    v.sort();
    v.dedup();
    Ok(v)
}

/// Human size: 4096 -> "4K".
pub fn fmt_size(s: usize) -> String {
    if s >= 1 << 20 && s % (1 << 20) == 0 {
        format!("{}M", s >> 20)
    } else if s >= 1 << 10 && s % (1 << 10) == 0 {
        format!("{}K", s >> 10)
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod t {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_sizes("8,64,4K").unwrap(), vec![8, 64, 4096]);
        assert_eq!(parse_sizes("0:8").unwrap(), vec![0, 1, 2, 4, 8]);
        assert_eq!(parse_sizes("1K:4K").unwrap(), vec![1024, 2048, 4096]);
        assert_eq!(parse_sizes("3:8").unwrap(), vec![3, 4, 8]);
        assert!(parse_sizes("8:1").is_err());
        assert!(parse_sizes("x").is_err());
        assert!(parse_sizes("").is_err());
        assert!(parse_sizes("2G").is_err());
        assert_eq!(fmt_size(4096), "4K");
        assert_eq!(fmt_size(3 << 20), "3M");
        assert_eq!(fmt_size(1000), "1000");
    }

    #[test]
    fn tests_parse() {
        assert_eq!(Test::parse("bw").unwrap(), Test::Bw);
        let e = Test::parse("nope").unwrap_err();
        assert!(e.contains("unknown test 'nope'") && e.contains("latency"));
    }
}
