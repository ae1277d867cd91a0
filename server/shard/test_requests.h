// Test-only ForwardRequests for the shard's transports (raw_forward_test, tcp_channel_test): a
// BF16 batch whose token t routes to experts t % 8 and (t + 3) % 8 of layer 1 (weights 0.75 and
// 0.25), F32 output, request id 42, with the hidden-state bytes apart from the header (a header
// for ForwardRaw and TCP channels; put them into hidden_states.data.data for Forward).
// Thread-safety: pure functions.
#ifndef MOE_SERVER_SHARD_TEST_REQUESTS_H_
#define MOE_SERVER_SHARD_TEST_REQUESTS_H_

#include <cstdint>
#include <string>

#include "moe/v1/shard.pb.h"

namespace moe {

// REQUIRES: the model has at least 8 experts and a layer 1. `payload` receives tokens * hidden
// BF16 values of small varied magnitudes, both signs.
v1::ForwardRequest RoutedBf16Header(int64_t tokens, int64_t hidden, std::string* payload);

}  // namespace moe

#endif  // MOE_SERVER_SHARD_TEST_REQUESTS_H_
