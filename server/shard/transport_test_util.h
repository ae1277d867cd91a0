// Test support for the shard's transports (raw_forward_test, tcp_channel_test, shm_forward_test):
// a generated model under the test's temporary directory with an in-process shard on it, and a
// ForwardRequest for it: a BF16 batch whose token t routes to experts t % 8 and (t + 3) % 8 of
// layer 1 (weights 0.75 and 0.25), F32 output, request id 42, with the hidden-state bytes apart
// from the header (a header for ForwardRaw and TCP channels; put them into
// hidden_states.data.data for Forward).
// Thread-safety: RoutedBf16Header is a pure function; TestModelDir writes the model once per test
// process (call it from one thread).
#ifndef MOE_SERVER_SHARD_TRANSPORT_TEST_UTIL_H_
#define MOE_SERVER_SHARD_TRANSPORT_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "moe/v1/shard.pb.h"
#include "server/shard/in_process_shard.h"

namespace moe {

// $TEST_TMPDIR/<name>, holding a default generated model with H = `hidden` (written on the first
// call).
absl::StatusOr<std::string> TestModelDir(const std::string& name, int64_t hidden);
// An in-process shard with `options` on TestModelDir(name, hidden).
absl::StatusOr<std::unique_ptr<InProcessShard>> StartTestShard(const std::string& name,
                                                               int64_t hidden,
                                                               InProcessShardOptions options = {});

// REQUIRES: the model has at least 8 experts and a layer 1. `payload` receives tokens * hidden
// BF16 values of small varied magnitudes, both signs.
v1::ForwardRequest RoutedBf16Header(int64_t tokens, int64_t hidden, std::string* payload);

}  // namespace moe

#endif  // MOE_SERVER_SHARD_TRANSPORT_TEST_UTIL_H_
