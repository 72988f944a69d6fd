#!/usr/bin/env bash
# A single-node Slurm cluster for the launch tests (issue 24): munged, slurmctld and slurmd from
# Debian's packages (tools/deps.sh installs them), configured under $WEFT_SLURM_DIR
# (default /tmp/weft-slurm) so that nothing in /etc is touched.
#   tools/slurm.sh up     start what is not running, wait until the node takes jobs, and print
#                         the path to export as SLURM_CONF
#   tools/slurm.sh down   stop the daemons this script started (munged too, if it started it)
#   tools/slurm.sh hold   as up, then wait until standard input closes (the process that started
#                         it exited, however: success, panic, SIGINT, SIGKILL) or a signal comes,
#                         and stop what this invocation started. The tests use it, so that no
#                         daemon outlives them; a cluster someone started with `up` is left up.
# One invocation at a time: a lock file serialises them (a second `hold` waits for the first to
# stop its daemons before it looks at the node).
# Needs root (slurmd runs job steps as their user; munged runs as the munge user). The node
# declares 1024 CPUs and allows 4096 tasks, whatever the machine has, so that srun can start as
# many ranks as the start-up benchmark asks for on two cores (SlurmdParameters=config_overrides).
set -euo pipefail
dir=${WEFT_SLURM_DIR:-/tmp/weft-slurm}
conf=$dir/slurm.conf
host=$(hostname -s)

die() { echo "tools/slurm.sh: $*" >&2; exit 1; }

lock() {
  mkdir -p "$dir"
  exec 9>"$dir/lock"
  flock -w 300 9 || die "another tools/slurm.sh has held $dir/lock for 5 minutes"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

up() {
  [ "$(id -u)" = 0 ] || die "needs root (slurmd starts job steps as their user)"
  for t in munged munge unmunge slurmctld slurmd srun sinfo scontrol; do
    command -v "$t" >/dev/null 2>&1 || [ -x "/usr/sbin/$t" ] \
      || die "$t is missing (Debian's munge, slurmctld, slurmd, slurm-client; tools/deps.sh installs them)"
  done
  mkdir -p "$dir/state" "$dir/spool"
  cat > "$conf.new" <<CONF
# written by tools/slurm.sh
ClusterName=weft
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=46817
SlurmdPort=46818
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
KillWait=5
MessageTimeout=30
MaxTasksPerNode=4096
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmdParameters=config_overrides
NodeName=$host CPUs=1024 Boards=1 SocketsPerBoard=1 CoresPerSocket=1024 ThreadsPerCore=1 RealMemory=1024 State=UNKNOWN
PartitionName=weft Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  # Reuse a running cluster whose configuration is unchanged and whose node takes jobs.
  export SLURM_CONF=$conf
  if cmp -s "$conf" "$conf.new" && [ "$(node_state)" = idle ]; then
    rm -f "$conf.new"
    echo "$conf"
    return 0
  fi
  down quiet
  mv "$conf.new" "$conf"
  started=1
  if ! munge_works; then
    pkill -x munged 2>/dev/null || true
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create >/dev/null
    runuser -u munge -- /usr/sbin/munged --force </dev/null >/dev/null 2>&1 9>&- || die "munged did not start"
    touch "$dir/munged.ours"
    for _ in $(seq 1 50); do munge_works && break; sleep 0.1; done
    munge_works || die "munged runs but does not answer on /run/munge/munge.socket.2"
  fi
  /usr/sbin/slurmctld -f "$conf" </dev/null >/dev/null 2>&1 9>&- \
    || die "slurmctld did not start (see $dir/slurmctld.log)"
  /usr/sbin/slurmd -f "$conf" </dev/null >/dev/null 2>&1 9>&- || die "slurmd did not start (see $dir/slurmd.log)"
  # Wait (bounded) until the node is idle and takes jobs.
  local state=none
  for _ in $(seq 1 60); do
    state=$(node_state)
    case "$state" in
      idle) echo "$conf"; return 0 ;;
      down|drain*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "the node did not become idle within 30 s (state '$state'; see $dir/slurmctld.log and $dir/slurmd.log)"
}

# The node's state as sinfo prints it (idle, down, unk...), without the flags; bounded.
node_state() {
  local s
  s=$(SLURM_CONF=$conf timeout 3 sinfo -h -N -o '%t' 2>/dev/null | head -1) || true
  echo "${s%%[*~#!%$@^-]}"
}

munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

down() {
  for d in slurmd slurmctld; do
    if alive "$dir/$d.pid"; then kill "$(cat "$dir/$d.pid")" 2>/dev/null || true; fi
  done
  for _ in $(seq 1 50); do
    alive "$dir/slurmd.pid" || alive "$dir/slurmctld.pid" || break
    sleep 0.1
  done
  # slurmd ignores SIGTERM while it retries its registration: make sure.
  for d in slurmd slurmctld; do
    if alive "$dir/$d.pid"; then kill -9 "$(cat "$dir/$d.pid")" 2>/dev/null || true; fi
  done
  # munged serves the whole host: stopped only if this script started it.
  local m=/run/munge/munged.pid
  if [ -f "$dir/munged.ours" ]; then
    if alive "$m"; then kill "$(cat "$m")" 2>/dev/null || true; fi
    for _ in $(seq 1 50); do alive "$m" || break; sleep 0.1; done
    if alive "$m"; then kill -9 "$(cat "$m")" 2>/dev/null || true; fi
    rm -f "$dir/munged.ours"
  fi
  [ "${1:-}" = quiet ] || echo "stopped"
}

# up, then block until standard input reaches its end or a signal comes; then stop what this
# invocation started. Its output after the path goes to $dir/hold.log: whoever reads the path
# may be gone by then, and a write to its pipe would kill the clean-up.
hold() {
  started=0 reader=
  trap 'exit 130' INT TERM HUP
  trap 'if [ -n "$reader" ]; then kill "$reader" 2>/dev/null; fi
        if [ "$started" = 1 ]; then down quiet; fi' EXIT
  up
  exec >>"$dir/hold.log" 2>&1
  exec 3<&0
  cat <&3 >/dev/null 9>&- &
  reader=$!
  wait "$reader" || true
  reader=
}

case "${1:-}" in
  up) lock; started=0; up ;;
  down) lock; down ;;
  hold) lock; hold ;;
  *) die "usage: tools/slurm.sh up|down|hold" ;;
esac
