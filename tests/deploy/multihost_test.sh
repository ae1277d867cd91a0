#!/usr/bin/env bash
# A cluster spread over four "hosts": the coordinator, two shards and a client each run in their
# own network namespace, wired through a bridge that lives in a fifth (switch) namespace, so every
# interface and address (10.213.0.0/24) exists only inside namespaces this test creates and the
# machine's own network is untouched. The real binaries run there; the client checks the shards'
# gRPC health from its namespace, sees the cluster map with the shards' namespace addresses,
# cannot reach a shard through its own loopback (separate network stacks), and runs a short
# verified workload (every output against the CPU reference, exact load counts), over gRPC and
# again over direct TCP channels (the shards run --tcp_channel).
#
# Where network namespaces cannot be created (no CAP_SYS_ADMIN, no veth support), it prints
# "SKIPPED: <why>" and exits 0. Namespaces and processes are removed on every exit.
set -euo pipefail

RUNFILES="${TEST_SRCDIR:?run under bazel test}/moe_serve"
WORK="$(mktemp -d "${TEST_TMPDIR:?}/multihost.XXXXXX")"
COORDINATOR_BIN="$RUNFILES/server/coordinator/moe_coordinator"
SHARD_BIN="$RUNFILES/server/shard/moe_shard"
MOECTL="$RUNFILES/client/moectl/moectl"
PROBE="$RUNFILES/tests/deploy/grpc_health_probe.py"

TAG="moe$$"  # namespace names unique to this run
SWITCH="$TAG-switch"
HOSTS=(coordinator shard0 shard1 client)
declare -A ADDR=([coordinator]=10.213.0.1 [shard0]=10.213.0.2 [shard1]=10.213.0.3
  [client]=10.213.0.4)
NAMESPACES=()
PIDS=()

cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  for ns in "${NAMESPACES[@]}"; do ip netns delete "$ns" 2>/dev/null || true; done
  if ((rc != 0)); then
    for log in "$WORK"/*.log; do
      [[ -f "$log" ]] && { echo "=== $log"; tail -n 30 "$log"; } >&2
    done
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

skip() {
  echo "SKIPPED: $* (the multi-host test needs to create network namespaces and veth pairs)"
  exit 0
}

in_ns() { local ns="$1"; shift; ip netns exec "$TAG-$ns" "$@"; }

# --- the network: a bridge in the switch namespace, one veth pair per host -------------------
command -v ip >/dev/null || skip "the ip command (iproute2) is not installed"
ip netns add "$SWITCH" 2>"$WORK/netns.err" || skip "ip netns add failed: $(cat "$WORK/netns.err")"
NAMESPACES+=("$SWITCH")
ip -n "$SWITCH" link add br0 type bridge 2>"$WORK/netns.err" ||
  skip "cannot create a bridge: $(cat "$WORK/netns.err")"
ip -n "$SWITCH" link set br0 up
for i in "${!HOSTS[@]}"; do
  h="${HOSTS[$i]}"
  ip netns add "$TAG-$h"
  NAMESPACES+=("$TAG-$h")
  ip -n "$SWITCH" link add "port$i" type veth peer name eth0 netns "$TAG-$h" \
    2>"$WORK/netns.err" || skip "cannot create a veth pair: $(cat "$WORK/netns.err")"
  ip -n "$SWITCH" link set "port$i" master br0 up
  ip -n "$TAG-$h" addr add "${ADDR[$h]}/24" dev eth0
  ip -n "$TAG-$h" link set eth0 up
  ip -n "$TAG-$h" link set lo up
done
echo "namespaces: ${NAMESPACES[*]}"
for h in "${HOSTS[@]}"; do echo "  $h: $(ip -n "$TAG-$h" -brief addr show dev eth0)"; done

# shellcheck source=tests/lib/servers.sh
source "$RUNFILES/tests/lib/servers.sh"  # wait_port

# --- the cluster --------------------------------------------------------------------------------
"$MOECTL" gen-model --out "$WORK/model" --format mxfp4 --layers 2 --experts 8 --top_k 2 \
  --hidden 128 --intermediate 64 --files 1 --seed 7 >/dev/null

# Started as plain background commands: `ip netns exec` execs the binary, so $! is the server.
ip netns exec "$TAG-coordinator" "$COORDINATOR_BIN" --host "${ADDR[coordinator]}" --port 0 \
  --port_file "$WORK/coordinator.port" --num_shards 2 --redundant_slots 4 \
  2>"$WORK/coordinator.log" &
PIDS+=($!)
COORDINATOR="${ADDR[coordinator]}:$(wait_port "$WORK/coordinator.port" "${PIDS[0]}")"
for rank in 0 1; do
  ip netns exec "$TAG-shard$rank" "$SHARD_BIN" --model "$WORK/model" --coordinator "$COORDINATOR" \
    --host "${ADDR[shard$rank]}" --port 0 --port_file "$WORK/shard$rank.port" --rank "$rank" \
    --backend cpu --tcp_channel 2>"$WORK/shard$rank.log" &
  PIDS+=($!)
done
SHARD_ADDRESSES=()
for rank in 0 1; do
  port="$(wait_port "$WORK/shard$rank.port" "${PIDS[$((rank + 1))]}")"
  SHARD_ADDRESSES+=("${ADDR[shard$rank]}:$port")
done

# --- what the client host sees ------------------------------------------------------------------
for address in "${SHARD_ADDRESSES[@]}"; do
  in_ns client /usr/bin/python3 "$PROBE" "$address" --wait 60
done
in_ns client "$MOECTL" map --coordinator "$COORDINATOR" | tee "$WORK/map.out"
for rank in 0 1; do
  grep -qE "rank $rank +${SHARD_ADDRESSES[$rank]//./\\.} +ready" "$WORK/map.out" ||
    { echo "FAIL: the map does not list shard $rank at ${SHARD_ADDRESSES[$rank]}"; exit 1; }
done
shard0_port="${SHARD_ADDRESSES[0]##*:}"
if in_ns client bash -c "exec 3<>/dev/tcp/127.0.0.1/$shard0_port" 2>/dev/null; then
  echo "FAIL: shard 0's port answers on the client's loopback: the hosts share a network stack"
  exit 1
fi
echo "the client's loopback does not reach shard 0 (port $shard0_port): separate network stacks"

in_ns client "$MOECTL" workload --coordinator "$COORDINATOR" --model "$WORK/model" --steps 24 \
  --tokens 8 --clients 2 | tee "$WORK/workload.out"
grep -q "coordinator load counts match the client's routed counts exactly" "$WORK/workload.out"
grep -q "verified 24 forwards" "$WORK/workload.out"

# The same over direct TCP channels: each shard's channel port, on its own address.
in_ns client "$MOECTL" workload --coordinator "$COORDINATOR" --model "$WORK/model" --steps 24 \
  --tokens 8 --clients 2 --transport tcp | tee "$WORK/workload_tcp.out"
grep -q "coordinator load counts match the client's routed counts exactly" "$WORK/workload_tcp.out"
grep -q "verified 24 forwards" "$WORK/workload_tcp.out"
for rank in 0 1; do
  grep -q "tcp channel: connection opened" "$WORK/shard$rank.log" ||
    { echo "FAIL: shard $rank served no tcp channel"; exit 1; }
done
echo "PASS: coordinator, 2 shards and a client in 4 network namespaces (gRPC and TCP channels)"
