#!/usr/bin/env bash
# What a C++ frontend waits for per forward, by transport: a coordinator and SHARDS moe-shard
# processes of a release bundle (all with --tcp_channel), then `moectl workload` (MoeClient:
# dispatch, one call per shard in parallel, combine) over each transport in turn, ROUNDS times,
# one client thread, calls back to back (--verify=false: a CPU-reference check between calls
# would let the servers' cores go idle and time their wake-ups). Prints each run's latency line.
#
#   bench/client_transport_bench.sh BUNDLE_TAR [BACKEND]   # BACKEND: cuda (default) or cpu
#   env: SHARDS (2), TOKENS (1), STEPS (300), ROUNDS (2), TRANSPORTS ("raw tcp proto"),
#        MODEL_FLAGS (moectl gen-model shape), WORKLOAD_FLAGS (more moectl workload flags, e.g.
#        --watch_map=false), OUT (logs; default /tmp/client_transport)
set -u
bundle="${1:?usage: $0 BUNDLE_TAR [cuda|cpu]}"
backend="${2:-cuda}"
shards="${SHARDS:-2}"
OUT="${OUT:-/tmp/client_transport}"
mkdir -p "$OUT"
# shellcheck source=bench/bundle_model.sh
source "$(dirname "$0")/bundle_model.sh"
unpack_bundle_with_model "$bundle" "--experts 32 --top_k 4 --hidden 2048 --intermediate 768"
port=$((50050 + RANDOM % 500))
bin/moe-coordinator --port $port --num_shards "$shards" > "$OUT/coordinator.log" 2>&1 &
sleep 1
for ((r = 0; r < shards; r++)); do
  bin/moe-shard --model "$m" --coordinator 127.0.0.1:$port --port $((port + 1 + r)) --rank $r \
    --backend "$backend" --tcp_channel > "$OUT/shard$r.log" 2>&1 &
done
failed=0
for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
  for transport in ${TRANSPORTS:-raw tcp proto}; do
    log="$OUT/workload-$transport-$round.log"
    timeout 300 bin/moectl workload --coordinator 127.0.0.1:$port --model "$m" \
      --steps "${STEPS:-300}" --tokens "${TOKENS:-1}" --clients 1 --transport "$transport" \
      --verify=false ${WORKLOAD_FLAGS:-} \
      > "$log" 2>&1 || failed=1
    echo "$transport (round $round): $(grep -o 'latency.*' "$log")"
  done
done
kill $(jobs -p) 2> /dev/null
wait 2> /dev/null
exit $failed
