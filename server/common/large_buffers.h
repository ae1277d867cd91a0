// Allocator tuning for processes that move multi-megabyte tensors per request (shards, benches).
//
// glibc serves allocations above M_MMAP_THRESHOLD (128 KiB, adapting up to 32 MiB) with fresh
// mmap()s and unmaps them on free, so every request's staging and output buffers are page-faulted
// and zeroed by the kernel again (perf on rpc_bench showed page faults + clear_page as a large
// share of a 4 MiB Forward). Raising the mmap and trim thresholds keeps such buffers in the heap
// for reuse. Call once at start-up, before threads are created. Not thread-safe.
#ifndef MOE_SERVER_COMMON_LARGE_BUFFERS_H_
#define MOE_SERVER_COMMON_LARGE_BUFFERS_H_

namespace moe {

// Heap-allocates buffers up to 256 MiB and keeps up to 1 GiB of freed heap top untrimmed.
// Returns false when glibc refused a setting (the process keeps working, only slower).
bool TuneAllocatorForLargeBuffers();

}  // namespace moe

#endif  // MOE_SERVER_COMMON_LARGE_BUFFERS_H_
