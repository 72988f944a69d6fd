#!/usr/bin/env bash
# weft-fi's rows for ../shared/peers/peers.sh (its --extra hook): unmodified third-party
# programs over weft as a libfabric provider, in the same interleaved repetitions as the peers.
#
#   cargo build --release -p weft-cli -p weft-fi
#   ../shared/peers/peers.sh --only openmpi,libfabric --reps 5 --sizes 8,64K,1M,4M \
#       --extra "$PWD/tools/peers-weft-fi.sh"
#
# Rows (peer "weft-fi" unless said): NPopenmpi over Open MPI's cm PML and mtl/ofi over weft-fi
# on shm, verbs-rc and hybrid (the soft HCA); fi_pingpong -p weft on shm; and weft's own
# `weft bench latency` on shm, so that the bridge's cost is a difference within one rep.
# (Open MPI 4.1.4's mtl/ofi does not initialise over libfabric 1.17's own shm provider, so
# there is no such row to compare with; peers.sh's vader and fi_pingpong -p shm rows are the
# peers.)
# Called as: peers-weft-fi.sh RAW_CSV REP (appends peer,transport,metric,size,rep,value rows).
set -uo pipefail
csv=$1 rep=$2
here=$(cd "$(dirname "$0")/.." && pwd)
rel=${WEFT_TARGET_DIR:-$here/target}/release
weft=$rel/weft
prov=$(mktemp -d /tmp/weft-fi-peers.XXXXXX)
trap 'rm -rf "$prov"' EXIT
cp "$rel/libweft_fi.so" "$prov/libweft-fi.so"
lat_sizes=${PEERS_LAT_SIZES:-8 65536}
bw_sizes=${PEERS_BW_SIZES:-1048576 4194304}
ompi=(/usr/bin/mpirun.openmpi --allow-run-as-root -np 2 --bind-to core --map-by core
  --mca oob_tcp_if_include lo --mca btl self)

# NetPIPE's one-size run; prints "lat_us MBps" from its Mbps column (peers.sh's convention).
netpipe() { # size, mpirun arguments...
  local s=$1 out=$prov/np.$1; shift
  rm -f "$out"
  timeout -k 3 120 "${ompi[@]}" "$@" /usr/bin/NPopenmpi -l "$s" -u "$s" -p 0 -o "$out" >/dev/null 2>&1 || return 1
  awk -v s="$s" 'END { if ($2 > 0) printf "%.4f %.1f\n", s * 8 / ($2 * 1.048576), $2 * 0.131072 }' "$out"
}

row() { # transport, size, "lat bw"
  local t=$1 s=$2 v=$3 lat bw
  [ -n "$v" ] || return 0
  read -r lat bw <<<"$v"
  for l in $lat_sizes; do [ "$l" = "$s" ] && echo "${peer:-weft-fi},$t,lat_us,$s,$rep,$lat" >>"$csv"; done
  for b in $bw_sizes; do [ "$b" = "$s" ] && echo "${peer:-weft-fi},$t,bw_MBps,$s,$rep,$bw" >>"$csv"; done
  return 0
}

for domain in shm verbs-rc hybrid; do
  for s in $lat_sizes $bw_sizes; do
    v=$(netpipe "$s" --mca pml cm --mca mtl ofi --mca mtl_ofi_provider_include weft \
      -x FI_PROVIDER=weft -x FI_PROVIDER_PATH="$prov" -x WEFT_PROVIDER=$domain \
      -x WEFT_VERBS_DEVICE=soft)
    row "NPopenmpi / Open MPI cm+mtl ofi / weft-fi $domain (ping-pong)" "$s" "$v"
  done
done

# fi_pingpong: rank 0 serves, rank 1 connects once the port listens; both pinned (--bind).
cat >"$prov/pp.sh" <<'EOF'
#!/bin/sh
port=$1; shift
if [ "$PMI_RANK" = 0 ]; then exec fi_pingpong -B "$port" "$@"; fi
i=0
until ss -Hltn "sport = :$port" | grep -q .; do
  i=$((i + 1)); [ $i -gt 3000 ] && exit 9
  sleep 0.01
done
exec fi_pingpong -P "$port" "$@" 127.0.0.1
EOF
chmod +x "$prov/pp.sh"
port=$((46000 + (rep * 37 + $$) % 2000))
for s in $lat_sizes $bw_sizes; do
  iters=$(( s <= 1024 ? 10000 : (1 << 28) / s ))
  port=$((port + 1))
  v=$(FI_PROVIDER_PATH=$prov timeout -k 3 120 "$weft" run --bind -n 2 --tag-output -- \
    "$prov/pp.sh" $port -p weft -d shm -e rdm -I $iters -S "$s" 2>/dev/null |
    awk -v s="$s" '/^\[0\] +[0-9]/ { u = $(NF-1) } END { if (u > 0) printf "%.4f %.1f\n", u, s / u }')
  row "fi_pingpong -p weft -d shm (ping-pong)" "$s" "$v"
done

# weft's own benchmark on shm, one rep per call (its median over 1 rep).
b=$prov/bench.csv
if timeout -k 3 300 "$weft" bench latency --providers shm --sizes 8,64K --reps 1 --csv "$b" >/dev/null 2>&1; then
  awk -F, -v rep="$rep" '$1 == "latency" && $2 == "shm" && ($4 == 8 || $4 == 65536) {
    printf "weft,weft bench latency shm (separate buffers),lat_us,%s,%s,%.4f\n", $4, rep, $6 }' "$b" >>"$csv"
fi
