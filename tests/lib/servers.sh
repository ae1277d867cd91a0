# Shell helpers for tests that start moe_coordinator / moe_shard processes on port 0. Sourced
# (bash); the caller keeps the server pids in the array PIDS and their logs in "$WORK"/*.log.

# Bounded polling (60 s) until a process has written its complete "PORT\n" line to FILE; prints
# the port. Fails early when process PID exits first.
wait_port() {
  local file="$1" pid="$2"
  for _ in $(seq 1 1200); do
    if [[ -f "$file" ]] && [[ "$(tail -c 1 "$file" | od -An -c | tr -d ' ')" == '\n' ]]; then
      tr -d '\n' <"$file"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "process $pid exited before writing $file" >&2; return 1; }
    sleep 0.05
  done
  echo "timed out waiting for $file" >&2
  return 1
}

# EXIT trap: stops every server in PIDS and, when the test failed, shows the tail of each log.
stop_servers() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if ((rc != 0)); then
    for log in "$WORK"/*.log; do
      [[ -f "$log" ]] && { echo "=== $log"; tail -n 40 "$log"; } >&2
    done
  fi
  exit "$rc"
}
