#!/usr/bin/env bash
# Install the Debian packages some tests need (and the benchmark's plot fonts), when they are
# missing. Tests never install anything themselves: without these they skip with the reason
# (or fail, under WEFT_REQUIRE_TOOLS=1, as in CI).
#   mpich      mpiexec.hydra, for the Hydra interop and two-host tests
#   openmpi-bin libpmix-dev   Open MPI's mpirun (a PMIx server) for the PMIx launch tests, and
#              PMIx's header, against which a test checks the layouts weft declares by hand
#   munge slurmctld slurmd slurm-client   a single-node Slurm (tools/slurm.sh starts it) for the
#              `srun --mpi=pmix` launch tests and the start-up table
#   iproute2   ip, for the two-network-namespace tests
#   valgrind   memcheck runs of the soundness tests in .ci/run
#   fonts-dejavu-core   the font `weft bench --plot` draws with
#   libfabric-dev libfabric-bin   libfabric's headers (weft-ofi-sys generates its bindings from them
#              with bindgen, found with pkg-config; the library itself is opened at run time) and
#              fi_pingpong, the `ofi:*` baselines of `weft bench`
#   libibverbs-dev cmake libclang-dev libnl-3-dev libnl-route-3-dev pkg-config
#              the rdma-core backend of weft-verbs (cargo feature `rdma-core`): the ibverbs-sys
#              crate configures rdma-core's headers with cmake and generates bindings with clang
set -euo pipefail
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v mpiexec.hydra >/dev/null 2>&1 || need+=(mpich)
command -v mpirun.openmpi >/dev/null 2>&1 || need+=(openmpi-bin)
[ -f /usr/lib/x86_64-linux-gnu/pmix2/include/pmix_common.h ] || need+=(libpmix-dev)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
[ -x /usr/sbin/slurmctld ] || need+=(slurmctld)
[ -x /usr/sbin/slurmd ] || need+=(slurmd)
command -v srun >/dev/null 2>&1 || need+=(slurm-client)
command -v valgrind >/dev/null 2>&1 || need+=(valgrind)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
[ -f /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
[ -f /usr/include/rdma/fi_tagged.h ] || need+=(libfabric-dev)
command -v fi_pingpong >/dev/null 2>&1 || need+=(libfabric-bin)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev)
[ -f /usr/include/libnl3/netlink/netlink.h ] || need+=(libnl-3-dev)
[ -f /usr/include/libnl3/netlink/route/link.h ] || need+=(libnl-route-3-dev)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
else
  echo "tools/deps.sh: cannot install ${need[*]} (not root or no apt-get); the tests that need them skip" >&2
fi
