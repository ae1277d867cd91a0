// Fuzz target forward_request: arbitrary bytes -> v1::ForwardRequest::ParseFromArray ->
// StageForwardRequest under a standalone placement and both ranks of a replicated 2-rank map.
// Inputs that parse and stage must satisfy the fixture's invariants; everything else must come
// back as INVALID_ARGUMENT without crashing or allocating more than the input justifies.
#include <cstddef>
#include <cstdint>

#include "moe/v1/shard.pb.h"
#include "tests/fuzz/fuzz_fixture.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moe::v1::ForwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  moe::fuzz::StageEverywhere(request);
  return 0;
}
