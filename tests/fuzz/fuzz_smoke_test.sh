#!/usr/bin/env bash
# Short form of the fuzz runs for ./moe test: builds every libFuzzer target with clang++-14 into
# TEST_TMPDIR (bench/fuzz/build.sh, from the sources this test declares as data) and runs each
# for 20,000 executions from its committed seed corpus. Fails on a crash, sanitizer report, leak,
# invariant violation, or an allocation over the limits that bench/fuzz/run.sh sets.
set -euo pipefail
ROOT="$TEST_SRCDIR/$TEST_WORKSPACE"
exec "$ROOT/bench/fuzz/run.sh" --runs 20000 --out "$TEST_TMPDIR/fuzz"
