# Sourced by the release-bundle benchmarks (client_transport_bench.sh, poll_strategy_bench.sh):
# unpack_bundle_with_model BUNDLE_TAR "DEFAULT MODEL FLAGS" unpacks the bundle into a fresh
# directory, changes into it and generates a one-layer MXFP4 model there with MODEL_FLAGS (or the
# defaults). Sets `root` (the directory) and `m` (the model); exits the script on failure.
unpack_bundle_with_model() {
  root=$(mktemp -d)
  tar xzf "$1" -C "$root"
  cd "$root"/moe-serve-* || exit 2
  m=$root/model
  # shellcheck disable=SC2086  # the flags are words on purpose
  bin/moectl gen-model --out "$m" --format mxfp4 --layers 1 ${MODEL_FLAGS:-$2} > /dev/null ||
    { echo "gen-model failed"; exit 1; }
}
