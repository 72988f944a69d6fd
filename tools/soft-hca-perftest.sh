#!/usr/bin/env bash
# perftest over the soft HCA's drop-in libibverbs.so.1 against weft bench's raw verbs tests on
# the same soft HCA, interleaved: R rounds, each runs ib_write_lat / ib_write_bw / ib_send_lat
# / ib_read_lat / ib_atomic_lat (perftest, through the drop-in) and weft bench's verbs_* of the
# same names (through weft-verbs directly); prints the medians and the ratio drop-in / direct.
# Usage: tools/soft-hca-perftest.sh [ROUNDS] (default 5). Builds release binaries first.
# Needs Debian's perftest and ss (tools/deps.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
cargo build -q --release -p weft-cli -p weft-ibverbs
target=${CARGO_TARGET_DIR:-target}
weft=$target/release/weft
eval "$("$weft" soft-hca env)"
port=$(( 22000 + $$ % 1000 ))  # below the ephemeral range (32768 up)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# perftest server (background) and client on this host; prints the client's result row.
pt() {
  port=$((port + 1))
  "$@" -p "$port" > "$work/srv" 2>&1 &
  local srv=$! i=0
  until ss -Hltn "sport = :$port" | grep -q .; do
    i=$((i + 1)); [ $i -gt 3000 ] && { echo "perftest server never listened" >&2; exit 1; }
    sleep 0.01
  done
  "$@" -p "$port" 127.0.0.1 > "$work/cli" 2>&1
  wait $srv
  awk '/#bytes/ {getline; print; exit}' "$work/cli"
}

# One figure of a weft bench table: test, size.
wb() {
  "$weft" bench "$1" --providers shm --sizes "$2" --reps 1 --env WEFT_VERBS_DEVICE=soft 2>/dev/null \
    | awk -v s="$2" '$1 == s {print $2; exit}'
}

: > "$work/rows"
for r in $(seq "$rounds"); do
  # t_typical (the median, µs) of the latency tests; BW average (MB/s, 2^20 bytes) of bw.
  echo "write_lat_8 drop-in $(pt ib_write_lat -s 8 -n 5000 | awk '{print $5}')" >> "$work/rows"
  echo "write_lat_8 direct $(wb verbs_write_lat 8)" >> "$work/rows"
  echo "send_lat_8 drop-in $(pt ib_send_lat -s 8 -n 5000 | awk '{print $5}')" >> "$work/rows"
  echo "send_lat_8 direct $(wb verbs_send_lat 8)" >> "$work/rows"
  echo "read_lat_8 drop-in $(pt ib_read_lat -s 8 -n 5000 | awk '{print $5}')" >> "$work/rows"
  echo "read_lat_8 direct $(wb verbs_read_lat 8)" >> "$work/rows"
  echo "atomic_lat_8 drop-in $(pt ib_atomic_lat -n 5000 | awk '{print $5}')" >> "$work/rows"
  echo "atomic_lat_8 direct $(wb verbs_atomic_lat 8)" >> "$work/rows"
  echo "write_lat_1M drop-in $(pt ib_write_lat -s 1048576 -n 500 | awk '{print $5}')" >> "$work/rows"
  echo "write_lat_1M direct $(wb verbs_write_lat 1M)" >> "$work/rows"
  echo "write_bw_64K drop-in $(pt ib_write_bw -s 65536 -n 5000 | awk '{print $4 * 1.048576}')" >> "$work/rows"
  echo "write_bw_64K direct $(wb verbs_write_bw 64K)" >> "$work/rows"
  echo "write_bw_1M drop-in $(pt ib_write_bw -s 1048576 -n 1000 | awk '{print $4 * 1.048576}')" >> "$work/rows"
  echo "write_bw_1M direct $(wb verbs_write_bw 1M)" >> "$work/rows"
done
echo "# soft HCA: perftest over the drop-in libibverbs.so.1 against weft bench on weft-verbs"
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) CPUs, $(uname -r), $(date -u '+%Y-%m-%d %H:%M UTC'), medians of $rounds interleaved rounds"
echo "# write/send latency: half the round trip, read/atomic: the whole, µs (perftest's t_typical,
# the median); bandwidth: MB/s (10^6 bytes)"
printf '%-14s %10s %10s %8s\n' test drop-in direct ratio
for t in write_lat_8 write_lat_1M send_lat_8 read_lat_8 atomic_lat_8 write_bw_64K write_bw_1M; do
  med() { grep "^$t $1 " "$work/rows" | awk '{print $3}' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
  d=$(med drop-in); w=$(med direct)
  printf '%-14s %10s %10s %8s\n' "$t" "$d" "$w" "$(awk -v a="$d" -v b="$w" 'BEGIN {printf "%.2f", a / b}')"
done
