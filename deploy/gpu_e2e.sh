#!/usr/bin/env bash
# End to end on a GPU machine, from the release bundle: a coordinator and two
# `moe-shard --backend cuda`, then `moectl workload` runs whose outputs are checked against the
# CPU reference (a failed check aborts before the report), for an MXFP4 gpt-oss-like model and
# an NVFP4 model with a shared expert; 16 tokens per step, 2 (one-token shard batches, which run
# as CUDA graphs) and 512 (the wgmma path), over ForwardRaw; then 16 tokens again over direct TCP
# channels (the shards run with --tcp_channel), and over moectl's default transport (auto: the
# same channels, the calls being plaintext); for NVFP4 also a live EPLB rebalance during a long
# workload (no failed call, outputs checked, the slowest call printed). Also: a shard asked for a device past those
# present (--cuda_device) must refuse to start, naming their count.
#
#   deploy/gpu_e2e.sh [BUNDLE_TAR]   # default: .bundle-rel/moe-serve-*.tar.gz
#
# Here: `bazel build //deploy:bundle && deploy/bundle.sh --install
# bazel-bin/deploy/moe-serve-bundle.tar.gz .bundle-rel`, then carry .bundle-rel and this script
# to the GPU machine. Logs go to $OUT (default /tmp/out). Exits 1 when a workload fails.
# SHARD_FLAGS="--cuda_concurrent_runs=1 ..." adds flags to both serving shards (A/B runs).
# PACK=1 packs the logs into one $OUT/out.tgz at the end (the device tool returns at most 8 files).
set -u
bundle="${1:-$(ls .bundle-rel/moe-serve-*.tar.gz 2> /dev/null | head -1)}"
[[ -f "$bundle" ]] || { echo "usage: $0 [moe-serve bundle .tar.gz]" >&2; exit 2; }
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
# PACK=1: on any exit the logs go into one archive, $OUT/out.tgz (the device tool returns at most
# 8 files).
pack_out() {
  local archive
  archive=$(mktemp --suffix=.tgz) && tar czf "$archive" -C "$OUT" . && rm -rf "${OUT:?}"/* &&
    mv "$archive" "$OUT"/out.tgz
}
[[ "${PACK:-0}" == 1 ]] && trap pack_out EXIT
root=$(mktemp -d)
tar xzf "$bundle" -C "$root"
cd "$root"/moe-serve-* || exit 2
failed=0
for fmt in mxfp4 nvfp4; do
  m=$root/model-$fmt
  if [[ $fmt == mxfp4 ]]; then shape="--hidden 2880 --intermediate 2880"; steps=10
  else shape="--hidden 1024 --intermediate 512 --shared_experts 1 --activation silu"; steps=40; fi
  bin/moectl gen-model --out "$m" --format $fmt --layers 3 --experts 16 $shape > /dev/null 2>&1 ||
    { echo "gen-model failed ($fmt)"; exit 1; }
  if [[ $fmt == mxfp4 ]]; then
    gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
    timeout 30 bin/moe-shard --model "$m" --backend cuda --cuda_device "$gpus" \
      > "$OUT/shard-bad-device.log" 2>&1
    rc=$?
    if ((rc != 0)) && grep -q "$gpus present" "$OUT/shard-bad-device.log"; then
      echo "moe-shard --cuda_device $gpus ($gpus GPUs): refused, rc=$rc"
    else
      echo "moe-shard --cuda_device $gpus ($gpus GPUs): not refused as expected, rc=$rc"
      failed=1
    fi
  fi
  port=$((50050 + RANDOM % 500))
  bin/moe-coordinator --port $port --num_shards 2 --redundant_slots 2 > "$OUT/coord-$fmt.log" 2>&1 &
  c=$!
  sleep 1
  for r in 0 1; do
    bin/moe-shard --model "$m" --coordinator 127.0.0.1:$port --port $((port + 1 + r)) --rank $r \
      --backend cuda --cuda_device 0 --tcp_channel ${SHARD_FLAGS:-} > "$OUT/shard$r-$fmt.log" 2>&1 &
  done
  for run in "$steps 16 raw" "12 2 raw" "3 512 raw" "$steps 16 tcp" "$steps 16 auto"; do
    read -r n tokens transport <<< "$run"
    log="$OUT/workload-$fmt-$tokens-$transport.log"
    timeout 180 bin/moectl workload --coordinator 127.0.0.1:$port --model "$m" --steps "$n" \
      --tokens "$tokens" --transport "$transport" > "$log" 2>&1
    rc=$?
    grep -E "verified|match" "$log"
    echo "workload $fmt, $tokens tokens x $n steps over $transport: rc=$rc"
    ((rc == 0)) || failed=1
  done
  # A live EPLB rebalance while a workload runs (NVFP4: its CPU check is fast enough for
  # thousands of steps): the shards upload the changed layers to the GPU while serving the old
  # map version, the coordinator commits, clients follow. No call may fail, every output is
  # checked, and the slowest call is printed beside the median (the switch's stall).
  if [[ $fmt == nvfp4 ]]; then
    # About 10 s of steps at the rate the auto run above measured.
    rate=$(sed -nE 's/^throughput ([0-9.]+) forwards.*/\1/p' "$OUT/workload-$fmt-16-auto.log")
    steps=$(awk -v r="${rate:-100}" 'BEGIN { s = int(r * 10); print s < 200 ? 200 : s }')
    # The same workload without a switch first: its slowest calls are the baseline.
    timeout 300 bin/moectl workload --coordinator 127.0.0.1:$port --model "$m" --steps "$steps" \
      --tokens 16 --clients 2 > "$OUT/workload-$fmt-steady.log" 2>&1
    echo "workload $fmt without a switch ($steps steps): rc=$?;" \
      "$(grep -hE "^(throughput|slowest)" "$OUT/workload-$fmt-steady.log" | tr '\n' ' ')"
    log="$OUT/workload-$fmt-rebalance.log"
    w_start_ns=$(date +%s%N)
    timeout 300 bin/moectl workload --coordinator 127.0.0.1:$port --model "$m" --steps "$steps" \
      --tokens 16 --clients 2 > "$log" 2>&1 &
    w=$!
    sleep 3
    start_ns=$(date +%s%N)
    timeout 120 bin/moectl rebalance --coordinator 127.0.0.1:$port --min_gain 0 \
      > "$OUT/rebalance-$fmt.log" 2>&1
    rrc=$?
    echo "rebalance under load: rc=$rrc, started $(( (start_ns - w_start_ns) / 1000000 )) ms" \
      "after the workload (moectl's own start included), $(( ($(date +%s%N) - start_ns) / 1000000 ))" \
      "ms to commit"
    grep -iE "map version|balancedness|moved" "$OUT/rebalance-$fmt.log" | head -4
    if ! kill -0 $w 2> /dev/null; then
      echo "the workload ended before the new map committed: the switch was not under load"
      failed=1
    fi
    wait $w
    rc=$?
    grep -E "verified|latency|slowest|match" "$log"
    echo "workload $fmt during the rebalance ($steps steps): rc=$rc"
    ((rc == 0 && rrc == 0)) || failed=1
    for r in 0 1; do
      grep -m1 -E "map version 2 active" "$OUT/shard$r-$fmt.log" || {
        echo "shard $r did not switch to map version 2"
        failed=1
      }
    done
  fi
  # Every shard answered the tcp run over its channels.
  for r in 0 1; do
    if ! grep -q "tcp channel: connection opened" "$OUT/shard$r-$fmt.log"; then
      echo "shard $r ($fmt): no tcp channel was opened"
      failed=1
    fi
  done
  timeout 20 bin/moectl info --shard 127.0.0.1:$((port + 1)) 2>&1 | grep -iE "backend|device" | head -3
  kill $(jobs -p) 2> /dev/null
  wait 2> /dev/null
done
exit $failed
