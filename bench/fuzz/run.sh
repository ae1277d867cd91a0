#!/usr/bin/env bash
# Runs the libFuzzer targets of tests/fuzz/ (building them first when needed) and prints, per
# target, executions, executions per second, peak RSS and whether it crashed. Each target starts
# from its committed seed corpus (tests/fuzz/corpus/<target>/, read-only) plus a working corpus
# under the build directory that keeps what earlier runs found. Limits on every run: RSS 2 GiB,
# any single allocation 512 MiB, 25 s per input; leaks are reported (LeakSanitizer).
#
# usage: bench/fuzz/run.sh [--seconds N | --runs N] [--out DIR] [--json FILE] [--fresh] [target...]
#   --seconds N  run each target for N seconds (default 60)
#   --runs N     run each target for N executions instead
#   --out DIR    build and working directory (default .cache/fuzz)
#   --json FILE  also write the results as JSON
#   --fresh      start from the seed corpus only (drop the working corpus)
#   target       forward_request forward_structured safetensors model_config wire_staging
#                transport_frames (default: all)
# Exit status: 0 when no target crashed, 1 otherwise (the reproducer path is printed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ARGS="$*"
ALL_TARGETS=(forward_request forward_structured safetensors model_config wire_staging
  transport_frames)
OUT="$ROOT/.cache/fuzz"
LIMIT=(-max_total_time=60)
JSON=""
FRESH=0
TARGETS=()
while (($#)); do
  case "$1" in
    --seconds) LIMIT=(-max_total_time="$2"); shift 2 ;;
    --runs) LIMIT=(-runs="$2"); shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --json) JSON="$2"; shift 2 ;;
    --fresh) FRESH=1; shift ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run.sh: unknown option '$1'" >&2; exit 2 ;;
    *)
      [[ " ${ALL_TARGETS[*]} " == *" $1 "* ]] || { echo "run.sh: unknown target '$1'" >&2; exit 2; }
      TARGETS+=("$1"); shift ;;
  esac
done
((${#TARGETS[@]})) || TARGETS=("${ALL_TARGETS[@]}")

"$ROOT/bench/fuzz/build.sh" --out "$OUT"
OUT="$(cd "$OUT" && pwd)"

# stat::<name> from a libFuzzer log (-print_final_stats=1).
fuzz_stat() { sed -n "s/^stat::$1: *//p" "$2" | tail -1; }

rows=()
crashed=0
printf '%-20s %12s %10s %9s %8s %s\n' target executions exec/s peak_rss seconds result
for t in "${TARGETS[@]}"; do
  work="$OUT/corpus/$t"
  ((FRESH)) && rm -rf "$work"
  mkdir -p "$work" "$OUT/artifacts" "$OUT/logs"
  log="$OUT/logs/$t.log"
  start_ns=$(date +%s%N)
  rc=0
  # Input length: libFuzzer's default, at least the largest seed (a generated checkpoint).
  "$OUT/bin/${t}_fuzzer" "${LIMIT[@]}" -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=25 \
    -print_final_stats=1 -artifact_prefix="$OUT/artifacts/$t-" \
    "$work" "$ROOT/tests/fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  ms=$((($(date +%s%N) - start_ns) / 1000000))
  seconds="$((ms / 1000)).$((ms % 1000 / 100))"
  runs=$(fuzz_stat number_of_executed_units "$log")
  # Over the whole run, start-up and seed loading included (libFuzzer's own figure rounds
  # short runs down to 0).
  rate=$(((${runs:-0} * 1000) / (ms > 0 ? ms : 1)))
  rss=$(fuzz_stat peak_rss_mb "$log")
  result=ok
  artifact=""
  if ((rc != 0)); then
    crashed=1
    result="CRASH (exit $rc)"
    artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)
  fi
  printf '%-20s %12s %10s %8sM %8s %s\n' "$t" "${runs:-?}" "$rate" "${rss:-?}" \
    "$seconds" "$result"
  if ((rc != 0)); then
    grep -m1 -E 'ERROR|runtime error|invariant violated|out-of-memory|leak' "$log" | sed 's/^/    /' || true
    echo "    log: $log"
    [[ -n "$artifact" ]] && echo "    reproduce: $OUT/bin/${t}_fuzzer $artifact"
  fi
  rows+=("$(printf '{"target": "%s", "executions": %s, "exec_per_sec": %s, "peak_rss_mb": %s, "seconds": %s, "crashed": %s, "corpus_files": %s}' \
    "$t" "${runs:-0}" "$rate" "${rss:-0}" "$seconds" "$([[ $rc == 0 ]] && echo false || echo true)" \
    "$(find "$work" -type f | wc -l)")")
done

if [[ -n "$JSON" ]]; then
  {
    printf '{\n  "command": "bench/fuzz/run.sh %s",\n' "$ARGS"
    printf '  "date": "%s",\n  "host_cpus": %s,\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(nproc)"
    printf '  "compiler": "%s",\n' "$(clang++-14 --version | head -1)"
    printf '  "limits": {"rss_limit_mb": 2048, "malloc_limit_mb": 512, "timeout_s": 25},\n'
    printf '  "targets": [\n'
    for i in "${!rows[@]}"; do
      printf '    %s%s\n' "${rows[$i]}" "$([[ $i -lt $((${#rows[@]} - 1)) ]] && echo ,)"
    done
    printf '  ]\n}\n'
  } >"$JSON"
  echo "results: $JSON"
fi
exit "$crashed"
