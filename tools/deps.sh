#!/usr/bin/env bash
# Install the Debian packages some tests need (and the benchmark's plot fonts), when they are
# missing. Tests never install anything themselves: without these they skip with the reason
# (or fail, under WEFT_REQUIRE_TOOLS=1, as in CI).
# The groups below say what each package is for. weft builds without any of them: libfabric
# (libfabric1, which libfabric-bin brings) is opened at run time, and its headers only let a
# test compare weft's checked-in bindings with them; the rdma-core group serves the ibverbs-sys
# crate of the optional `rdma-core` feature (cmake configures rdma-core's headers, clang
# generates bindings). apt's output goes to
# target/deps.log; the terminal gets one line per group. About 55 packages and 2 minutes on a
# fresh Debian 12.
set -euo pipefail
cd "$(dirname "$0")/.."
# Groups, one line each when something of it is missing: a label, then "test package" pairs
# (the test is a shell condition that holds when the package's part is present).
groups=()
need=()
group() { # label, then pairs of (condition, package)
  local label=$1 missing=(); shift
  while [ $# -gt 0 ]; do
    eval "$1" >/dev/null 2>&1 || missing+=("$2")
    shift 2
  done
  if [ ${#missing[@]} -gt 0 ]; then
    groups+=("$label: ${missing[*]}")
    need+=("${missing[@]}")
  fi
}
group "MPICH's Hydra and mpicc (interop, two-host tests, MPICH over UCX over the soft HCA)" \
  'command -v mpiexec.hydra' mpich \
  '[ -f /usr/include/x86_64-linux-gnu/mpich/mpi.h ]' libmpich-dev \
  'command -v NPmpich2' netpipe-mpich2
group "Open MPI's mpirun, mpicc and PMIx (PMIx launch tests, Open MPI over weft-fi)" \
  'command -v mpirun.openmpi' openmpi-bin \
  'command -v mpicc.openmpi' libopenmpi-dev \
  'command -v NPopenmpi' netpipe-openmpi \
  '[ -f /usr/lib/x86_64-linux-gnu/pmix2/include/pmix_common.h ]' libpmix-dev
group "mpi4py (its own test suite over Open MPI over weft-fi)" \
  '/usr/bin/python3 -c "import mpi4py"' python3-mpi4py
group "single-node Slurm (srun launch tests, start-up table)" \
  'command -v munged || [ -x /usr/sbin/munged ]' munge \
  '[ -x /usr/sbin/slurmctld ]' slurmctld \
  '[ -x /usr/sbin/slurmd ]' slurmd \
  'command -v srun' slurm-client
group "network namespaces (two-host tests)" 'command -v ip' iproute2
group "memcheck (.ci/run)" 'command -v valgrind' valgrind
group "plot font (weft bench --plot)" '[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]' fonts-dejavu-core
group "libfabric (ofi provider at run time, fi_pingpong baselines, headers for the bindings test)" \
  'command -v fi_pingpong' libfabric-bin \
  '[ -f /usr/include/rdma/fi_tagged.h ]' libfabric-dev
group "verbs programs over the soft HCA's libibverbs.so.1 (ibverbs-utils, perftest, UCX)" \
  'command -v ibv_rc_pingpong' ibverbs-utils \
  'command -v ib_write_lat' perftest \
  'command -v ucx_info' ucx-utils
group "rdma-core backend (cargo feature rdma-core)" \
  '[ -f /usr/include/infiniband/verbs.h ]' libibverbs-dev \
  'command -v cmake' cmake \
  'command -v pkg-config' pkg-config \
  'ls /usr/lib/llvm-*/lib/libclang.so' libclang-dev \
  '[ -f /usr/include/libnl3/netlink/netlink.h ]' libnl-3-dev \
  '[ -f /usr/include/libnl3/netlink/route/link.h ]' libnl-route-3-dev
install_packages() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "tools/deps.sh: cannot install ${need[*]} (not root or no apt-get); the tests that need them skip" >&2
    return 0
  fi
  mkdir -p target
  log=$PWD/target/deps.log
  : > "$log"
  t0=$(date +%s)
  echo "tools/deps.sh: updating Debian's package lists (apt's output: $log)"
  if ! apt-get update -qq >>"$log" 2>&1; then
    tail -20 "$log" >&2
    echo "tools/deps.sh: apt-get update failed (the whole log: $log)" >&2
    return 1
  fi
  total=$(apt-get install -s "${need[@]}" 2>/dev/null | grep -c '^Inst' || true)
  echo "tools/deps.sh: installing ${#need[@]} packages, ${total} with their dependencies (about 2 min on a fresh machine):"
  for g in "${groups[@]}"; do echo "  $g"; done
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >>"$log" 2>&1; then
    tail -20 "$log" >&2
    echo "tools/deps.sh: apt-get install failed (the whole log: $log)" >&2
    return 1
  fi
  echo "tools/deps.sh: done in $(( $(date +%s) - t0 )) s"
}

# mpi4py's own test suite (its source distribution's test/; Debian's package has none), for
# the version Debian installed, unpacked into target/mpi4py-VERSION/test.
fetch_mpi4py_tests() {
  local v dir
  v=$(/usr/bin/python3 -c 'import mpi4py; print(mpi4py.__version__)' 2>/dev/null) || return 0
  dir=target/mpi4py-$v
  [ -f "$dir/test/runtests.py" ] && return 0
  mkdir -p target
  if /usr/bin/python3 - "$v" target <<'PY'
import hashlib, io, re, sys, tarfile, urllib.request
v, out = sys.argv[1], sys.argv[2]
# PyPI's simple index names the file and its sha256.
index = urllib.request.urlopen("https://pypi.org/simple/mpi4py/", timeout=60).read().decode()
url, digest = re.search(rf'href="([^"#]*/mpi4py-{re.escape(v)}\.tar\.gz)#sha256=([0-9a-f]+)"', index).groups()
data = urllib.request.urlopen(url, timeout=120).read()
if hashlib.sha256(data).hexdigest() != digest:
    sys.exit(f"mpi4py-{v}.tar.gz: sha256 mismatch")
with tarfile.open(fileobj=io.BytesIO(data)) as t:
    t.extractall(out, members=[m for m in t.getmembers() if m.name.startswith(f"mpi4py-{v}/test/")])
PY
  then
    echo "tools/deps.sh: mpi4py $v's test suite in $dir/test (from PyPI)"
  else
    echo "tools/deps.sh: could not fetch mpi4py $v's test suite from PyPI; its test skips" >&2
  fi
}

if [ ${#need[@]} -gt 0 ]; then
  install_packages
fi
fetch_mpi4py_tests
