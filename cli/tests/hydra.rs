//! Interop with MPICH's Hydra (`mpiexec.hydra`, PMI-1 over PMI_FD) and a two-host run across
//! two network namespaces joined by a veth pair.

mod common;
use common::*;
use std::path::PathBuf;
use std::process::Command;

/// `mpiexec.hydra`, if installed. Tests never install software (`tools/deps.sh` does, and
/// `.ci/run` runs it): a missing tool skips the test with the reason, or fails it under
/// `WEFT_REQUIRE_TOOLS=1` (which `.ci/run` sets, so CI cannot pass by skipping).
fn hydra() -> Option<PathBuf> {
    let found = ["/usr/bin/mpiexec.hydra", "/usr/local/bin/mpiexec.hydra"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    if found.is_none() {
        skip("mpiexec.hydra is missing (Debian's mpich; tools/deps.sh installs it)");
    }
    found
}

#[test]
fn hydra_runs_ring_over_every_process_provider() {
    let Some(mpiexec) = hydra() else { return };
    let ring = example("weft-cli", "ring");
    for p in ["shm", "tcp-sim"] {
        let o = run_bounded(
            Command::new(&mpiexec)
                .args(["-n", "4", "-genv", "WEFT_PROVIDER", p])
                .arg(&ring),
            120,
        );
        assert!(o.status.success(), "{p}: {}\n{}", stdout(&o), stderr(&o));
        assert!(
            stdout(&o).contains(&format!("ring: ok over 4 ranks on 1 host(s), provider {p}")),
            "{}",
            stdout(&o)
        );
    }
    assert!(
        shm_leftovers().is_empty(),
        "left in /dev/shm: {:?}",
        shm_leftovers()
    );
}

/// Two network namespaces joined by a veth pair; removed on drop.
struct TwoHosts {
    ns: [String; 2],
    ip: [String; 2],
    dir: PathBuf,
}

impl TwoHosts {
    fn create() -> Result<TwoHosts, String> {
        let id = std::process::id();
        let net = 16 + id % 200;
        let ns = [format!("wefta{id}"), format!("weftb{id}")];
        let ip = [format!("10.{net}.7.1"), format!("10.{net}.7.2")];
        let (va, vb) = (format!("wa{id}"), format!("wb{id}"));
        let t = TwoHosts {
            ns: ns.clone(),
            ip: ip.clone(),
            dir: std::env::temp_dir().join(format!("weft-netns-{id}")),
        };
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), ns[0].clone()],
            vec!["netns".into(), "add".into(), ns[1].clone()],
            vec![
                "link".into(),
                "add".into(),
                va.clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                vb.clone(),
            ],
            vec![
                "link".into(),
                "set".into(),
                va.clone(),
                "netns".into(),
                ns[0].clone(),
            ],
            vec![
                "link".into(),
                "set".into(),
                vb.clone(),
                "netns".into(),
                ns[1].clone(),
            ],
            vec![
                "-n".into(),
                ns[0].clone(),
                "addr".into(),
                "add".into(),
                format!("{}/24", ip[0]),
                "dev".into(),
                va.clone(),
            ],
            vec![
                "-n".into(),
                ns[1].clone(),
                "addr".into(),
                "add".into(),
                format!("{}/24", ip[1]),
                "dev".into(),
                vb.clone(),
            ],
            vec![
                "-n".into(),
                ns[0].clone(),
                "link".into(),
                "set".into(),
                va,
                "up".into(),
            ],
            vec![
                "-n".into(),
                ns[1].clone(),
                "link".into(),
                "set".into(),
                vb,
                "up".into(),
            ],
            vec![
                "-n".into(),
                ns[0].clone(),
                "link".into(),
                "set".into(),
                "lo".into(),
                "up".into(),
            ],
            vec![
                "-n".into(),
                ns[1].clone(),
                "link".into(),
                "set".into(),
                "lo".into(),
                "up".into(),
            ],
        ];
        for s in steps {
            let o = run_bounded(Command::new("ip").args(&s), 30);
            if !o.status.success() {
                return Err(format!("ip {}: {}", s.join(" "), stderr(&o).trim()));
            }
        }
        std::fs::create_dir_all(&t.dir).map_err(|e| e.to_string())?;
        // Hydra's launcher calls `LAUNCHER -x HOST "proxy command" args...` as it would ssh.
        let script = format!(
            "#!/bin/sh\n[ \"$1\" = \"-x\" ] && shift\nhost=$1; shift\ncase $host in\n  {}) ns={};;\n  {}) ns={};;\n  *) echo \"unknown host $host\" >&2; exit 1;;\nesac\nexec ip netns exec $ns sh -c \"$*\"\n",
            ip[0], ns[0], ip[1], ns[1]
        );
        let path = t.dir.join("launcher");
        std::fs::write(&path, script).map_err(|e| e.to_string())?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        Ok(t)
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for n in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn two_namespaces_are_two_hosts() {
    let Some(mpiexec) = hydra() else { return };
    let hosts = match TwoHosts::create() {
        Ok(h) => h,
        Err(e) => {
            skip(&format!(
                "this machine does not allow network namespaces here: {e}"
            ));
            return;
        }
    };
    let ring = example("weft-cli", "ring");
    let launch_n = |ppn: &str, n: &str, extra: &[&str], program: &[&std::ffi::OsStr]| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &hosts.ns[0]])
            .arg(&mpiexec)
            .args(["-launcher", "ssh", "-launcher-exec"])
            .arg(hosts.dir.join("launcher"))
            .args(["-localhost", &hosts.ip[0]])
            .args(["-hosts", &format!("{},{}", hosts.ip[0], hosts.ip[1])])
            .args(["-ppn", ppn, "-n", n])
            .args(extra)
            .args(program);
        run_bounded(&mut c, 300)
    };
    let launch = |extra: &[&str], program: &[&std::ffi::OsStr]| launch_n("2", "4", extra, program);
    let run = |extra: &[&str]| launch(extra, &[ring.as_os_str()]);
    // Default selection: tcp-sim between the hosts (shared memory cannot span them), shm
    // between the two ranks of each host.
    let o = run(&[]);
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("ring: ok over 4 ranks on 2 host(s), provider tcp-sim+shm"),
        "{out}"
    );
    assert!(
        out.contains("on host 0 ok=true") && out.contains("on host 1 ok=true"),
        "{out}"
    );
    // Which provider carried what: Hydra places ranks 0,1 on the first host and 2,3 on the
    // second, so hops 0->1 and 2->3 stay on a host and 1->2, 3->0 cross.
    for line in out.lines().filter(|l| l.starts_with("ring: rank ")) {
        let r: u32 = line["ring: rank ".len()..]
            .split(' ')
            .next()
            .and_then(|x| x.parse().ok())
            .expect("rank");
        let get = |k: &str| -> u64 {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{k} in {line}"))
        };
        let (on_host, across) = (get("host.bytes"), get("net.bytes"));
        if r % 2 == 0 {
            assert!(on_host > 3_000_000 && across < 1000, "{line}");
        } else {
            assert!(across > 3_000_000 && on_host < 1000, "{line}");
        }
    }
    // The conformance suite on the composition, ranks started by Hydra in both namespaces.
    let o = launch(
        &[],
        &[weft().as_os_str(), std::ffi::OsStr::new("test-rank")],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("PROVIDER tcp-sim+shm"), "{out}");
    assert_eq!(out.matches("CHECK pass").count(), 16, "{out}");
    assert!(!out.contains("CHECK fail"), "{out}");
    // verbs-rc for every pair (no host provider): RC connections made on first use, within
    // a host through the soft HCA's shared segments, across the hosts through its wire service;
    // every eager design with every rendezvous mode (fast-path slots from the third message).
    let combos = ["fastpath", "basic", "piggyback", "pipeline"]
        .into_iter()
        .flat_map(|e| ["read", "write", "copy"].map(|r| (e, r)));
    for (eager, rndv) in combos {
        let o = launch(
            &[
                "-genv",
                "WEFT_PROVIDER",
                "verbs-rc",
                "-genv",
                "WEFT_SHM_PROVIDER",
                "none",
                "-genv",
                "WEFT_VERBS_DEVICE",
                "soft",
                "-genv",
                "WEFT_VERBS_RC_EAGER",
                eager,
                "-genv",
                "WEFT_VERBS_RC_FP_THRESHOLD",
                "2",
                "-genv",
                "WEFT_VERBS_RC_RNDV",
                rndv,
            ],
            &[weft().as_os_str(), std::ffi::OsStr::new("test-rank")],
        );
        let out = stdout(&o);
        assert!(o.status.success(), "{eager}/{rndv}: {out}\n{}", stderr(&o));
        assert!(out.contains("PROVIDER verbs-rc"), "{out}");
        assert_eq!(
            out.matches("CHECK pass").count(),
            16,
            "{eager}/{rndv}: {out}"
        );
        assert!(!out.contains("CHECK fail"), "{eager}/{rndv}: {out}");
    }
    // The soft HCA between the two hosts, one rank on each: every request of rank 0 crosses
    // the veth pair to rank 1's wire service while rank 1 is in no HCA call.
    let peers = example("weft-cli", "verbs_peers");
    let o = launch_n(
        "1",
        "2",
        &["-genv", "WEFT_VERBS_DEVICE", "soft"],
        &[peers.as_os_str()],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("verbs_peers: rank 0 ok on host 0"), "{out}");
    assert!(
        out.contains(
            "verbs_peers: rank 1 ok on host 1 device soft (requests served for other hosts: 6)"
        ),
        "{out}"
    );
    // Asking for shm across hosts is a clear error, not a hang.
    let o = run(&["-genv", "WEFT_PROVIDER", "shm"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("shared memory reaches only ranks on one host"),
        "{:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
}
