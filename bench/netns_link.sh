#!/usr/bin/env bash
# Why: hierarchical communication (ZeRO++, issue 22) only pays off when the
# link between nodes is much slower than the memory inside a node, and this
# project has one machine. This script makes "two nodes joined by a slow
# link" out of one Linux machine: two network namespaces (zero-node0,
# zero-node1) joined by a veth pair, whose both ends are rate-limited with a
# token-bucket filter (tc tbf), and runs Open MPI jobs as "2 nodes of 2
# ranks" across them: shared memory inside a node, TCP over the veth between
# nodes. It prints what crossed the link (the veth byte counters) and the wall
# time, so that a benchmark's bytes and times can be checked, not assumed.
#
#   bench/netns_link.sh up [--rate 1gbit] [--burst B] [--latency L] [--mtu M]
#   bench/netns_link.sh down
#   bench/netns_link.sh status
#   bench/netns_link.sh run [--ppn 2] [link options] -- CMD [ARGS...]
#   bench/netns_link.sh selftest [--rate 1gbit] [--mib 64] [link options]
#
# up        (re)creates the link; an existing one is torn down first.
# down      removes the namespaces (and anything still running in them); no
#           error when there is nothing to remove.
# run       runs CMD as an MPI job, --ppn ranks in each namespace (ranks
#           0..ppn-1 on node 0, the rest on node 1). If the link is not up it
#           is brought up with the link options and torn down afterwards
#           (also on error or Ctrl-C); a link that was up is left up. Prints
#           the veth counters and the wall time on stderr, exits with CMD's
#           status.
# selftest  brings the link up, runs bench/netns_pingpong.cpp (compiled with
#           mpicxx into a temporary directory) with 64 MiB messages, compares
#           the measured MB/s with the configured rate and the veth bytes
#           with the bytes the program sent, and tears the link down. Exit 0
#           when the rates are 70-105% of the configured rate and the byte
#           ratio is 0.95-1.10, else 1.
#
# Needs: root (namespaces, veth and tc need CAP_SYS_ADMIN/CAP_NET_ADMIN),
# iproute2 (ip, tc) with the tbf qdisc, util-linux (unshare); Open MPI
# (mpirun, and mpicxx for selftest). Without them: a message and exit 77
# (the "skipped" status of Meson and Automake tests).
#
# Environment:
#   ZERO_LINK_BTL         Open MPI BTLs (default self,vader,tcp; self,tcp puts
#                         intra-node traffic on TCP over loopback too)
#   ZERO_LINK_TCP_FLAGS   btl_tcp_flags (default send,inplace,need-ack,need-csum;
#                         "default" keeps Open MPI's own, see below)
#   ZERO_LINK_MPIRUN_ARGS more mpirun arguments (split on spaces)
set -euo pipefail

readonly NS=(zero-node0 zero-node1)
readonly IFACE=(zveth0 zveth1)        # the veth end inside each namespace
readonly ADDR=(10.77.0.1 10.77.0.2)
readonly PREFIXLEN=24
readonly SUBNET=10.77.0.0/24
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly HERE
readonly LOCK=/run/lock/zero-netns-link.lock

# Link options (set by parse_link_opts).
RATE=1gbit
BURST=""
LATENCY=50ms
MTU=1500

log() { echo "netns_link: $*" >&2; }
die() { log "error: $*"; exit 1; }
skip() { log "SKIP: $*"; exit 77; }

usage() {
  sed -n '/^#   bench/p' "${BASH_SOURCE[0]}" | sed 's/^#  //' >&2
  exit 2
}

# --- prerequisites --------------------------------------------------------

need_link_tools() {
  [[ $(id -u) -eq 0 ]] || skip "needs root: network namespaces, veth pairs and tc qdiscs need CAP_SYS_ADMIN/CAP_NET_ADMIN (run as root or under sudo)"
  local t
  for t in ip tc unshare; do
    command -v "$t" >/dev/null || skip "'$t' not found (apt-get install iproute2 util-linux)"
  done
}

need_mpi() {
  command -v mpirun >/dev/null || skip "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
  # The MCA options below are Open MPI's; MPICH's mpiexec would reject them.
  mpirun --version 2>/dev/null | grep -q "Open MPI" || skip "mpirun is not Open MPI (the launch uses Open MPI's rsh agent and MCA options)"
}

# One instance at a time: two scripts setting up the same namespaces would
# tear each other's link down.
take_lock() {
  command -v flock >/dev/null || return 0
  exec 9>"$LOCK"
  flock -w 120 9 || die "another netns_link.sh holds $LOCK"
}

# --- numbers --------------------------------------------------------------

# tc's rate syntax to bytes per second: bit kbit mbit gbit tbit (and a bare
# number) are bits, bps kbps mbps gbps tbps are BYTES per second, as in tc(8);
# kibit/mibit/gibit and kibps/mibps/gibps are the binary forms.
rate_bytes() {
  awk -v r="$1" 'BEGIN {
    r = tolower(r)
    if (!match(r, /^[0-9]+(\.[0-9]+)?/)) exit 1
    n = substr(r, 1, RLENGTH); u = substr(r, RLENGTH + 1)
    m[""] = 1/8; m["bit"] = 1/8
    m["kbit"] = 1e3/8; m["mbit"] = 1e6/8; m["gbit"] = 1e9/8; m["tbit"] = 1e12/8
    m["kibit"] = 1024/8; m["mibit"] = 1048576/8; m["gibit"] = 1073741824/8
    m["bps"] = 1; m["kbps"] = 1e3; m["mbps"] = 1e6; m["gbps"] = 1e9; m["tbps"] = 1e12
    m["kibps"] = 1024; m["mibps"] = 1048576; m["gibps"] = 1073741824
    if (!(u in m) || n * m[u] < 1000) exit 1
    printf "%.0f\n", n * m[u]
  }'
}

# tc's size syntax (burst) to bytes: a bare number or b are bytes, k/kb m/mb
# g/gb are KiB MiB GiB, kbit mbit gbit are 1024-based bits, as tc(8) reads them.
size_bytes() {
  awk -v r="$1" 'BEGIN {
    r = tolower(r)
    if (!match(r, /^[0-9]+(\.[0-9]+)?/)) exit 1
    n = substr(r, 1, RLENGTH); u = substr(r, RLENGTH + 1)
    m[""] = 1; m["b"] = 1; m["k"] = 1024; m["kb"] = 1024
    m["m"] = 1048576; m["mb"] = 1048576; m["g"] = 1073741824; m["gb"] = 1073741824
    m["kbit"] = 128; m["mbit"] = 131072; m["gbit"] = 134217728
    if (!(u in m)) exit 1
    printf "%.0f\n", n * m[u]
  }'
}

# Default burst: 1 ms worth of the rate, at least 16 KiB.
# Why: tbf lets `burst` bytes through at memory speed after an idle spell, so
# a large burst makes small messages look free (a real 1 Gbit/s port needs
# 8 ms for 1 MB); 1 ms keeps that error to 1 ms per message. Much smaller is
# not better: the kernel then wakes the qdisc for every few packets, which
# costs CPU on a small machine, and a burst below one full frame (1514 bytes
# at MTU 1500) would drop packets outright; 16 KiB is about ten frames (and
# the floor is two frames with a larger --mtu).
# (1gbit: 125000 bytes; 200mbit: 25000; 10mbit: 16384.) Measured at 200mbit
# with 64 MiB messages, bursts of 25000 and 131072 gave the same rate.
default_burst() {
  awk -v b="$1" -v f="$(($2 + 14))" 'BEGIN {
    x = b / 1000; if (x < 16384) x = 16384; if (x < 2 * f) x = 2 * f
    printf "%.0f\n", x }'
}
# Default latency 50ms: tbf's queue holds rate x latency + burst bytes and
# drops beyond it. A queue too short for TCP's bursts drops packets, and the
# retransmissions then inflate the veth counters and cut the rate; 50 ms
# (6.25 MB at 1gbit, 1.25 MB at 200mbit) saw no drops in the self-test. The
# cost is queueing delay under load, which the default congestion control
# here (BBR, which paces) keeps small; `run` prints the drops so that a bad
# choice shows.

parse_link_opts() {
  # Sets RATE BURST LATENCY MTU; leaves the rest in REST.
  REST=()
  while [[ $# -gt 0 ]]; do
    case $1 in
      --rate) RATE=${2:?--rate needs a value}; shift 2 ;;
      --burst) BURST=${2:?--burst needs a value}; shift 2 ;;
      --latency) LATENCY=${2:?--latency needs a value}; shift 2 ;;
      --mtu) MTU=${2:?--mtu needs a value}; shift 2 ;;
      --rate=*) RATE=${1#*=}; shift ;;
      --burst=*) BURST=${1#*=}; shift ;;
      --latency=*) LATENCY=${1#*=}; shift ;;
      --mtu=*) MTU=${1#*=}; shift ;;
      *) REST+=("$1"); shift ;;
    esac
  done
  RATE_BPS=$(rate_bytes "$RATE") || die "cannot read rate '$RATE' (e.g. 1gbit, 200mbit, 125mbps)"
  [[ -n $BURST ]] || BURST=$(default_burst "$RATE_BPS" "$MTU")
  [[ $MTU =~ ^[0-9]+$ && $MTU -ge 1280 ]] || die "--mtu wants a number >= 1280, got '$MTU'"
  # A frame larger than the bucket can never be sent: tbf drops it.
  local b
  b=$(size_bytes "$BURST") || die "cannot read burst '$BURST' (bytes, or e.g. 64kb, 1mbit)"
  ((b >= MTU + 14)) || die "burst $BURST is below one full frame ($((MTU + 14)) bytes at MTU $MTU)"
}

# --- the link -------------------------------------------------------------

ns_exists() { [[ -e /run/netns/$1 ]]; }
link_exists() { ns_exists "${NS[0]}" || ns_exists "${NS[1]}"; }

# Removes both namespaces. Processes still inside them (a killed job's
# daemons) would keep a namespace alive after `ip netns del`, so they are
# ended first; they are ours: only this script starts things in there.
link_down() {
  local ns pids i
  for ns in "${NS[@]}"; do
    ns_exists "$ns" || continue
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    if [[ -n $pids ]]; then
      log "ending processes left in $ns: ${pids//$'\n'/ }"
      # shellcheck disable=SC2086
      kill -TERM $pids 2>/dev/null || true
      for i in 1 2 3 4 5 6 7 8 9 10; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [[ -z $pids ]] && break
        sleep 0.2
      done
      # shellcheck disable=SC2086
      [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
    fi
    # Deleting the namespace destroys the veth end in it, and with it the peer.
    ip netns del "$ns" 2>/dev/null || log "warning: could not delete namespace $ns"
  done
  # A setup that failed half-way can leave a veth in this namespace.
  for i in "${IFACE[@]}"; do
    ip link del "$i" 2>/dev/null || true
  done
}

link_up() {
  link_exists && { log "link exists: tearing it down first"; link_down; }
  # Until the end of this function a failure tears down what was made.
  trap 'link_down' ERR
  ip netns add "${NS[0]}" 2>/dev/null ||
    { trap - ERR; link_down; skip "cannot create network namespaces here (a container without CAP_SYS_ADMIN?)"; }
  ip netns add "${NS[1]}"
  # Created directly inside the namespaces: no name clash with this
  # namespace's interfaces, nothing left here if a later step fails.
  ip link add name "${IFACE[0]}" netns "${NS[0]}" mtu "$MTU" type veth \
    peer name "${IFACE[1]}" netns "${NS[1]}" mtu "$MTU"
  local i
  for i in 0 1; do
    ip -n "${NS[i]}" link set lo up    # Open MPI's local daemons talk over it
    ip -n "${NS[i]}" addr add "${ADDR[i]}/$PREFIXLEN" dev "${IFACE[i]}"
    ip -n "${NS[i]}" link set "${IFACE[i]}" up
  done
  # tbf on the egress of BOTH ends: a qdisc shapes only what leaves its
  # interface, so each end limits one direction, as on a full-duplex link.
  for i in 0 1; do
    if ! tc -n "${NS[i]}" qdisc add dev "${IFACE[i]}" root tbf \
        rate "$RATE" burst "$BURST" latency "$LATENCY" 2>/dev/null; then
      trap - ERR
      link_down
      skip "tc cannot add a tbf qdisc (kernel without sch_tbf?) or rejects rate=$RATE burst=$BURST latency=$LATENCY"
    fi
  done
  trap - ERR
  log "up: ${NS[0]}/${IFACE[0]} ${ADDR[0]} <-> ${NS[1]}/${IFACE[1]} ${ADDR[1]}, tbf rate $RATE ($(awk -v b="$RATE_BPS" 'BEGIN{printf "%.1f", b/1e6}') MB/s) burst $BURST latency $LATENCY, mtu $MTU, each direction"
}

link_status() {
  local i
  for i in 0 1; do
    if ns_exists "${NS[i]}"; then
      echo "${NS[i]}:"
      ip -n "${NS[i]}" -br addr show dev "${IFACE[i]}" 2>/dev/null | sed 's/^/  /' || true
      tc -n "${NS[i]}" -s qdisc show dev "${IFACE[i]}" 2>/dev/null | sed 's/^/  /' || true
    else
      echo "${NS[i]}: absent"
    fi
  done
}

# --- counters -------------------------------------------------------------

# "veth_tx veth_rx lo_tx tbf_sent tbf_dropped" for node $1. The counters are
# read inside the namespace: ip netns exec mounts that namespace's /sys.
# tbf's "Sent" counts each GSO segment with its own headers (what a wire
# would carry); the veth counts a GSO packet once, headers included once.
counters() {
  local i=$1 v tcs
  v=$(ip netns exec "${NS[i]}" cat \
    "/sys/class/net/${IFACE[i]}/statistics/tx_bytes" \
    "/sys/class/net/${IFACE[i]}/statistics/rx_bytes" \
    /sys/class/net/lo/statistics/tx_bytes | tr '\n' ' ')
  tcs=$(tc -n "${NS[i]}" -s qdisc show dev "${IFACE[i]}" |
    awk '/Sent/ { gsub(",", ""); print $2, $7; exit }')
  echo "$v ${tcs:-0 0}"
}

mb() { awk -v b="$1" 'BEGIN { printf "%.2f MB", b / 1e6 }'; }

# --- running MPI across the namespaces ------------------------------------

MPIRUN_PID=""      # the running mpirun, if any
MPIRUN_LAST=""     # the last one started
RUN_TMP=""         # mpi_run's temporary directory
# For the exit trap: stop_mpirun ends a job still running (interrupted), ours
# by its pid (mpirun ends its daemons and ranks when it gets TERM);
# run_cleanup removes what an interrupted job leaves behind: our temporary directory and the session
# directories of that mpirun (Open MPI's <tmp>/ompi.<host>.<uid>/pid.<mpirun
# pid>, one per host name: this machine's for mpirun, the nodes' for their
# daemons).
stop_mpirun() {
  local i
  if [[ -n ${MPIRUN_PID:-} ]] && kill -TERM "$MPIRUN_PID" 2>/dev/null; then
    for i in $(seq 50); do
      kill -0 "$MPIRUN_PID" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$MPIRUN_PID" 2>/dev/null || true
  fi
}
run_cleanup() {
  local d
  if [[ -n ${MPIRUN_LAST:-} ]]; then
    for d in "$(hostname)" "${NS[@]}"; do
      d=${TMPDIR:-/tmp}/ompi.$d.$(id -u)
      rm -rf "$d/pid.$MPIRUN_LAST"
      rmdir "$d" 2>/dev/null || true
    done
  fi
  [[ -z $RUN_TMP ]] || rm -rf "$RUN_TMP"
}

# Runs "$@" as an MPI job with $PPN ranks per node (its output into the file
# $RUN_OUT when that is set); sets RUN_RC, RUN_WALL and
# the counter deltas D_TX[i] D_RX[i] D_LO[i] D_TBF[i] D_DROP[i]; prints the
# report on stderr. The caller makes sure the link is up.
mpi_run() {
  local hostfile btl flags i
  RUN_TMP=$(mktemp -d "${TMPDIR:-/tmp}/zero-netns.XXXXXX")
  hostfile=$RUN_TMP/hostfile
  printf '%s slots=%d\n' "${NS[0]}" "$PPN" "${NS[1]}" "$PPN" >"$hostfile"
  btl=${ZERO_LINK_BTL:-self,vader,tcp}
  flags=${ZERO_LINK_TCP_FLAGS:-send,inplace,need-ack,need-csum}
  local -a args=(
    --allow-run-as-root
    --hostfile "$hostfile" -np $((2 * PPN)) --map-by slot
    # Both "nodes" share this machine's cores: each daemon binding its ranks
    # to cores 0..ppn-1 would put rank 0 and rank ppn on the same core.
    --bind-to none
    # Launch: the agent runs each node's daemon inside its namespace. Tree
    # spawn (daemons launching daemons) is off: two nodes need no tree.
    --mca plm_rsh_agent "$HERE/netns_rsh.sh"
    --mca plm_rsh_no_tree_spawn 1
    # Transport: self for a rank to itself, vader (shared memory) between
    # ranks of one node, tcp for everything else. Open MPI uses vader only
    # for peers its daemons report on the same node; the agent's per-node
    # host names keep the segment files apart (see netns_rsh.sh).
    --mca btl "$btl"
    # TCP, both the MPI traffic and the daemons' out-of-band channel, only
    # on the veth subnet (each namespace has lo and the veth; lo would do for
    # a node's own daemon, but the HNP in node 0 must reach node 1).
    --mca btl_tcp_if_include "$SUBNET"
    --mca oob_tcp_if_include "$SUBNET"
    # Idle ranks give up the CPU: on a small machine 2 x ppn ranks share
    # few cores, and spinning ranks slow the ones moving data.
    --mca mpi_yield_when_idle 1
  )
  # Why not Open MPI's default btl_tcp_flags (send,put,inplace,need-ack,
  # need-csum,hetero-rdma): with "put", large messages go as one emulated
  # RDMA write, and two ranks exchanging large messages at once (MPI_Sendrecv
  # across the link) got half the link rate each way (57-60 of 119 MB/s at
  # 1gbit, Open MPI 4.1.4) while raw TCP sockets both ways got 114-117; with
  # send fragments only (128 KiB each) the exchange runs at 108-116 MB/s
  # each way and one-way transfers are unchanged. A bandwidth harness should
  # show the link, not that.
  [[ $flags == default ]] || args+=(--mca btl_tcp_flags "$flags")
  if [[ -n ${ZERO_LINK_MPIRUN_ARGS:-} ]]; then
    # shellcheck disable=SC2206
    args+=(${ZERO_LINK_MPIRUN_ARGS})
  fi

  local -a before after
  for i in 0 1; do before[i]=$(counters "$i"); done
  local t0 t1
  t0=$(date +%s.%N)
  # mpirun runs in node 0's namespace, so that its out-of-band address is on
  # the veth subnet; its node has no ranks of its own (its host name is not
  # in the hostfile): both nodes' ranks are started through the agent.
  # In the background and waited for: bash runs a trap only once the
  # foreground command is over, and `wait` lets a TERM or ^C reach our trap
  # (which stops mpirun) at once. `<&0` keeps stdin, which a background
  # command would otherwise lose; mpirun passes it to rank 0.
  set +e
  if [[ -n ${RUN_OUT:-} ]]; then
    ip netns exec "${NS[0]}" mpirun "${args[@]}" "$@" >"$RUN_OUT" 2>&1 <&0 &
  else
    ip netns exec "${NS[0]}" mpirun "${args[@]}" "$@" <&0 &
  fi
  MPIRUN_PID=$!   # ip netns exec execs mpirun: this is mpirun's pid
  MPIRUN_LAST=$MPIRUN_PID
  wait "$MPIRUN_PID"
  RUN_RC=$?
  MPIRUN_PID=""
  set -e
  t1=$(date +%s.%N)
  for i in 0 1; do after[i]=$(counters "$i"); done
  rm -rf "$RUN_TMP"
  RUN_TMP=""

  RUN_WALL=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
  local -a b a
  for i in 0 1; do
    read -r -a b <<<"${before[i]}"
    read -r -a a <<<"${after[i]}"
    D_TX[i]=$((a[0] - b[0])); D_RX[i]=$((a[1] - b[1])); D_LO[i]=$((a[2] - b[2]))
    D_TBF[i]=$((a[3] - b[3])); D_DROP[i]=$((a[4] - b[4]))
  done
  log "mpirun exit status $RUN_RC, wall time $RUN_WALL s ($((2 * PPN)) ranks, $PPN per node, btl $btl)"
  for i in 0 1; do
    log "  ${NS[i]}/${IFACE[i]}: tx $(mb "${D_TX[i]}") (${D_TX[i]} B), rx $(mb "${D_RX[i]}") (${D_RX[i]} B); tbf sent ${D_TBF[i]} B, dropped ${D_DROP[i]} pkt; lo tx $(mb "${D_LO[i]}")"
  done
  log "  across the link: $(mb $((D_TX[0] + D_TX[1]))) (veth tx, both directions; lo: traffic inside a node that went over TCP, not shared memory)"
}

# --- selftest -------------------------------------------------------------

selftest() {
  local mib=64
  local -a rest=("${REST[@]}")
  while [[ ${#rest[@]} -gt 0 ]]; do
    case ${rest[0]} in
      --mib) mib=${rest[1]:?--mib needs a value}; rest=("${rest[@]:2}") ;;
      *) die "selftest: unknown option '${rest[0]}'" ;;
    esac
  done
  command -v mpicxx >/dev/null || skip "mpicxx not found (apt-get install libopenmpi-dev)"

  local tmp out
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/zero-netns-selftest.XXXXXX")
  # From here on, whatever happens, the link and the temporary files go.
  trap 'stop_mpirun; link_down; run_cleanup; rm -rf "'"$tmp"'"' EXIT
  trap 'exit 130' INT TERM
  log "compiling bench/netns_pingpong.cpp"
  mpicxx -O2 -std=c++20 "$HERE/netns_pingpong.cpp" -o "$tmp/pingpong" ||
    die "mpicxx failed"
  link_up
  PPN=2
  out=$tmp/out.txt
  RUN_OUT=$out mpi_run "$tmp/pingpong" "$mib" </dev/null
  cat "$out"
  [[ $RUN_RC -eq 0 ]] || die "the ping-pong job failed (status $RUN_RC)"
  local result
  result=$(grep '^PINGPONG_RESULT' "$out") || die "no PINGPONG_RESULT line in the job's output"
  getv() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$result"; }
  local inter intra fwd rev bi intra_rate data
  inter=$(getv inter_bytes); intra=$(getv intra_bytes)
  fwd=$(getv oneway_MBps); rev=$(getv reverse_MBps); bi=$(getv bidir_MBps)
  intra_rate=$(getv intra_MBps); data=$(getv data)

  local link_bytes=$((D_TX[0] + D_TX[1])) wire_bytes=$((D_TBF[0] + D_TBF[1]))
  local lo_bytes=$((D_LO[0] + D_LO[1]))
  local btl=${ZERO_LINK_BTL:-self,vader,tcp}
  local shm=0
  [[ ,$btl, == *,vader,* || ,$btl, == *,sm,* ]] && shm=1
  # All the arithmetic and the verdict in one place.
  awk -v rate="$RATE_BPS" -v rname="$RATE" -v fwd="$fwd" -v rev="$rev" -v bi="$bi" \
      -v intra_rate="$intra_rate" -v inter="$inter" -v intra="$intra" \
      -v link="$link_bytes" -v wire="$wire_bytes" -v lo="$lo_bytes" -v shm="$shm" \
      -v drops="$((D_DROP[0] + D_DROP[1]))" -v data="$data" -v wall="$RUN_WALL" -v mib="$mib" '
    function pct(x) { return 100 * x * 1e6 / rate }
    BEGIN {
      r = rate / 1e6
      printf "selftest: configured %s = %.2f MB/s each way; %g MiB messages; job wall %.2f s\n", rname, r, mib, wall
      printf "selftest: node0 -> node1  %7.2f MB/s  %5.1f%% of the rate\n", fwd, pct(fwd)
      printf "selftest: node1 -> node0  %7.2f MB/s  %5.1f%%\n", rev, pct(rev)
      printf "selftest: both at once    %7.2f MB/s  %5.1f%% (each way)\n", bi, pct(bi)
      printf "selftest: inside a node   %7.2f MB/s  (%s)\n", intra_rate, shm ? "shared memory" : "TCP over loopback"
      printf "selftest: payload across the link %d B; veth tx %d B, ratio %.4f; tbf (per-segment headers) %d B, ratio %.4f; tbf drops %d\n", inter, link, link / inter, wire, wire / inter, drops
      printf "selftest: loopback carried %d B for %d B exchanged inside the nodes\n", lo, intra
      bad = ""
      if (data != "ok") bad = bad " data corrupt;"
      if (pct(fwd) < 70 || pct(fwd) > 105) bad = bad " node0->node1 rate out of 70-105%;"
      if (pct(rev) < 70 || pct(rev) > 105) bad = bad " node1->node0 rate out of 70-105%;"
      if (pct(bi) < 70 || pct(bi) > 105) bad = bad " two-way rate out of 70-105%;"
      if (link / inter < 0.95 || link / inter > 1.10) bad = bad " veth bytes / payload out of 0.95-1.10;"
      if (shm && lo > 0.1 * intra) bad = bad " intra-node traffic went over TCP, not shared memory;"
      if (bad != "") { printf "selftest: FAIL:%s\n", bad; exit 1 }
      print "selftest: PASS"
    }' || exit 1
}

# --- main -----------------------------------------------------------------

main() {
  [[ $# -ge 1 ]] || usage
  local cmd=$1
  shift
  case $cmd in
    up)
      need_link_tools; take_lock
      parse_link_opts "$@"
      [[ ${#REST[@]} -eq 0 ]] || die "up: unknown argument '${REST[0]}'"
      link_up
      ;;
    down)
      need_link_tools; take_lock
      link_down
      ;;
    status)
      need_link_tools
      link_status
      ;;
    run)
      need_link_tools; need_mpi; take_lock
      PPN=2
      local -a opts=()
      while [[ $# -gt 0 && $1 != -- ]]; do
        case $1 in
          --ppn) PPN=${2:?--ppn needs a value}; shift 2 ;;
          *) opts+=("$1"); shift ;;
        esac
      done
      [[ $# -ge 2 && $1 == -- ]] || die "run: usage: run [--ppn N] [link options] -- CMD [ARGS...]"
      shift
      [[ $PPN =~ ^[1-9][0-9]*$ ]] || die "--ppn wants a positive number"
      parse_link_opts "${opts[@]}"
      [[ ${#REST[@]} -eq 0 ]] || die "run: unknown option '${REST[0]}'"
      # Interrupted: stop the job; and a link brought up here goes down on
      # any exit, including errors and ^C. A link that was up stays up.
      trap 'exit 130' INT TERM
      if link_exists; then
        [[ ${#opts[@]} -eq 0 ]] || log "the link is up already: link options ignored ('down' first to change them)"
        trap 'stop_mpirun; run_cleanup' EXIT
      else
        trap 'stop_mpirun; link_down; run_cleanup' EXIT
        link_up
      fi
      mpi_run "$@"
      exit "$RUN_RC"
      ;;
    selftest)
      need_link_tools; need_mpi; take_lock
      parse_link_opts "$@"
      selftest
      ;;
    -h | --help | help) usage ;;
    *) log "unknown command '$cmd'"; usage ;;
  esac
}

main "$@"
