#!/usr/bin/env bash
# Start-up at scale (issue 24; docs/launching.md): the time from launch to the exit of every
# rank under weft run, Hydra, Open MPI's mpirun and Slurm's srun, in interleaved runs.
#   tools/startup.sh [-r REPS] [-t SECS] N...      e.g. tools/startup.sh -r 3 64 256 1024
# Two programs: /bin/true (the launcher alone) and the ring example with RING_LAPS=0 (weft's
# init and finalize; provider $STARTUP_PROVIDER, default verbs-ud on the soft HCA). Prints one
# line per run (launcher, ranks, program, seconds or "failed"/"timeout") and then a table of
# medians. A launcher that is not installed is left out and said so; srun needs the cluster of
# tools/slurm.sh hold (root; stopped when this script ends); a failed run's most frequent lines go to standard error.
# Build first: cargo build --release -p weft-cli --examples --bins.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=3 limit=300
while getopts "r:t:" o; do
  case $o in r) reps=$OPTARG ;; t) limit=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || set -- 64 256
provider=${STARTUP_PROVIDER:-verbs-ud}
weft=target/release/weft ring=target/release/examples/ring
[ -x "$weft" ] && [ -x "$ring" ] || { echo "build first: cargo build --release -p weft-cli --examples --bins" >&2; exit 1; }

launchers=(weft-run)
command -v mpiexec.hydra >/dev/null && launchers+=(hydra) || echo "# no mpiexec.hydra (mpich): Hydra left out" >&2
command -v mpirun.openmpi >/dev/null && launchers+=(mpirun) || echo "# no mpirun.openmpi: Open MPI left out" >&2
# The cluster lives while this script does: the holder stops what it started when our end of
# its stdin closes, at our exit however it comes.
coproc SLURM_HOLD { exec bash tools/slurm.sh hold 2>/dev/null; }
if read -r -t 400 conf <&"${SLURM_HOLD[0]}" && [ -n "$conf" ]; then
  export SLURM_CONF=$conf
  launchers+=(srun)
else
  echo "# no single-node Slurm (tools/slurm.sh hold failed): srun left out" >&2
fi

env_for() { # the weft variables, in each launcher's way of passing them
  case $1 in
    weft-run|srun) echo "" ;;
    hydra) echo "-genv WEFT_PROVIDER $provider -genv WEFT_VERBS_DEVICE soft -genv RING_LAPS 0" ;;
    mpirun) echo "-x WEFT_PROVIDER=$provider -x WEFT_VERBS_DEVICE=soft -x RING_LAPS=0" ;;
  esac
}
cmd_for() { # launcher ranks program...
  local l=$1 n=$2; shift 2
  case $l in
    weft-run) echo "$weft run -n $n -- $*" ;;
    hydra) echo "mpiexec.hydra -n $n $(env_for hydra) $*" ;;
    mpirun) echo "mpirun.openmpi --oversubscribe --allow-run-as-root --mca btl self,tcp -n $n $(env_for mpirun) $*" ;;
    srun) echo "srun --quiet --mpi=pmix -n $n $*" ;;
  esac
}

median() { # launcher ranks program -> the median of the runs that finished, and how many did not
  local ok bad k
  ok=$(awk -v l="$1" -v n="$2" -v p="$3" '$1==l && $2==n && $3==p && $4 ~ /^[0-9.]+$/ {print $4}' "$results" | sort -n)
  bad=$(awk -v l="$1" -v n="$2" -v p="$3" '$1==l && $2==n && $3==p && $4 !~ /^[0-9.]+$/' "$results" | wc -l)
  k=$(echo "$ok" | grep -c . || true)
  if [ "$k" = 0 ]; then [ "$bad" = 0 ] && echo "-" || echo "all $bad failed"; return; fi
  # The middle run, or the mean of the two middle ones.
  printf '%s' "$(echo "$ok" | awk -v k="$k" '{ v[NR] = $1 } END {
    if (k % 2) printf "%.3f", v[(k + 1) / 2]; else printf "%.3f", (v[k / 2] + v[k / 2 + 1]) / 2 }')"
  [ "$bad" = 0 ] || printf ' (%s failed)' "$bad"
  echo
}

results=$(mktemp) log=$(mktemp)
trap 'rm -f "$results" "$log"' EXIT
for n in "$@"; do
  for rep in $(seq 1 "$reps"); do
    for prog in true weft; do
      for l in "${launchers[@]}"; do
        if [ $prog = true ]; then p=/bin/true; else p=$ring; fi
        c=$(cmd_for "$l" "$n" "$p")
        t0=$(date +%s%N)
        if WEFT_PROVIDER=$provider WEFT_VERBS_DEVICE=soft RING_LAPS=0 \
          timeout -k 5 "$limit" $c >"$log" 2>&1; then
          t=$(( ($(date +%s%N) - t0) / 1000000 ))
          s=$(printf '%d.%03d' $((t / 1000)) $((t % 1000)))
        else
          rc=$?
          if [ $rc = 124 ] || [ $rc = 137 ]; then s=timeout; else s=failed; fi
          # Why, in a few lines (on standard error, so the table stays clean).
          grep -v ' ok=' "$log" | sort | uniq -c | sort -rn | head -3 | sed "s|^|# $l $n $prog: |" >&2
          pkill -f -x "$p" 2>/dev/null || true
        fi
        printf '%s %s %s %s\n' "$l" "$n" "$prog" "$s" | tee -a "$results"
      done
    done
  done
done

echo
echo "median seconds of $reps runs ($(nproc) CPUs, $(uname -r), $(date -u +%FT%RZ)); provider $provider"
printf '| ranks | program |'; for l in "${launchers[@]}"; do printf ' %s |' "$l"; done; echo
printf '|---|---|'; for _ in "${launchers[@]}"; do printf -- '---|'; done; echo
for prog in true weft; do
  for n in "$@"; do
    printf '| %s | %s |' "$n" "$([ $prog = true ] && echo /bin/true || echo 'init + finalize')"
    for l in "${launchers[@]}"; do
      printf ' %s |' "$(median "$l" "$n" "$prog")"
    done
    echo
  done
done
