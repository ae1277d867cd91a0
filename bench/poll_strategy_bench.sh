#!/usr/bin/env bash
# gRPC's polling engine on each side of a shard call. For each server strategy a standalone
# moe-shard of a release bundle runs under GRPC_POLL_STRATEGY=<it>; rpc_bench --shard_address then
# measures it under each client strategy (the env var is read once per process, at gRPC's start).
# Prints rpc_bench's table per pair and writes its JSON as OUT/rpc_<server>_<client>.json.
#
#   bench/poll_strategy_bench.sh BUNDLE_TAR RPC_BENCH [BACKEND]   # BACKEND: cuda (default), cpu
#   env: STRATEGIES ("epoll1 poll"), RPC_FLAGS (rpc_bench flags, default one token, one client,
#        ping/raw/tcp/stream, think 0 and 1000 us), MODEL_FLAGS (moectl gen-model shape, default
#        problem C), OUT (default /tmp/poll_strategy)
set -u
bundle="${1:?usage: $0 BUNDLE_TAR RPC_BENCH [cuda|cpu]}"
rpc_bench="$(realpath "${2:?usage: $0 BUNDLE_TAR RPC_BENCH [cuda|cpu]}")"
backend="${3:-cuda}"
OUT="${OUT:-/tmp/poll_strategy}"
mkdir -p "$OUT"
# shellcheck source=bench/bundle_model.sh
source "$(dirname "$0")/bundle_model.sh"
unpack_bundle_with_model "$bundle" "--experts 128 --top_k 8 --hidden 2048 --intermediate 768"
failed=0
for server in ${STRATEGIES:-epoll1 poll}; do
  port=$((50050 + RANDOM % 500))
  GRPC_POLL_STRATEGY=$server bin/moe-shard --model "$m" --port $port --backend "$backend" \
    --tcp_channel --metrics_port=-1 > "$OUT/shard_$server.log" 2>&1 &
  shard=$!
  for _ in $(seq 1 600); do
    grep -q "serving\|listening" "$OUT/shard_$server.log" 2> /dev/null && break
    sleep 0.1
  done
  for client in ${STRATEGIES:-epoll1 poll}; do
    echo "== server $server, client $client"
    GRPC_POLL_STRATEGY=$client timeout 300 "$rpc_bench" --shard_address=127.0.0.1:$port \
      --routes=uniform \
      ${RPC_FLAGS:---tokens=1 --clients=1 --modes=ping,raw,tcp,stream --think_us=0,1000 --seconds=1} \
      --out_json="$OUT/rpc_${server}_${client}.json" 2>&1 | grep -E "^(mode|ping|raw|tcp|stream|proto) " ||
      failed=1
  done
  kill $shard 2> /dev/null
  wait $shard 2> /dev/null
done
exit $failed
