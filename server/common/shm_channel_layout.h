// Control block of a same-host shared-memory request channel (moe.v1.SharedMemoryShard
// OpenChannel). It sits at a 64-byte aligned offset inside a region both processes map; both run
// on one host, so fields are native-endian.
//
// Protocol, one request in flight per channel:
//   client: writes a serialized moe.v1.ShmForwardRequest (its tensor ranges refer to registered
//           regions, as for SharedMemoryShard.Forward) into `request`, sets `request_len`, then
//           request_seq += 1 (release) and FUTEX_WAKE on request_seq.
//   shard:  a thread per channel waits until request_seq differs from the last value it served,
//           copies request_len and the request bytes into its own memory before using them
//           (the client can scribble on the block at any time), serves it like Forward, writes
//           `status_code` (a google.rpc code), `response_len` and `response` (a serialized
//           moe.v1.ForwardResponse when status_code is 0, else the error message), then
//           response_seq = that request_seq (release) and FUTEX_WAKE on response_seq.
//   client: waits until response_seq equals its request_seq, then reads the response.
// A request posted while an earlier one is still being served supersedes it only if the shard has
// not read it yet (it serves the newest sequence number it sees).
//
// Thread-safety: the block is shared between two processes; the futex words are the only
// synchronization. Header-only: used by server/shard/shm_channel and client/shm_channel.
#ifndef MOE_SERVER_COMMON_SHM_CHANNEL_LAYOUT_H_
#define MOE_SERVER_COMMON_SHM_CHANNEL_LAYOUT_H_

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace moe {

// Room for the header of a request of ~64K tokens x top-8 routes (ids + weights, 8 bytes each),
// and for a response that returns its routing. Untouched pages cost no memory.
inline constexpr size_t kShmChannelRequestBytes = 1 << 20;
inline constexpr size_t kShmChannelResponseBytes = 1 << 20;

struct alignas(64) ShmChannelBlock {
  std::atomic<uint32_t> request_seq;
  char pad0[60];
  std::atomic<uint32_t> response_seq;
  char pad1[60];
  uint32_t request_len;
  uint32_t response_len;
  int32_t status_code;
  uint32_t reserved;
  char pad2[48];
  char request[kShmChannelRequestBytes];
  char response[kShmChannelResponseBytes];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
inline constexpr size_t kShmChannelBlockBytes = sizeof(ShmChannelBlock);

// Waits while *word == expected, at most `timeout` (spurious returns allowed). Shared (not
// process-private) futex: the word lives in memory mapped by two processes.
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, const timespec& timeout) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout, nullptr, 0);
}

inline void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

// How long a waiter polls the word before it sleeps on the futex. A futex wake-up costs tens of
// microseconds on a busy or virtualized host (the channel's one-token round trip, futex only:
// p50 19 us on a quiet 2-core VM, 77-113 us on the same VM later; bench/results/NOTES-cpu.md);
// a short poll catches an answer that is already on its way for the price of that much CPU.
inline constexpr std::chrono::microseconds kShmChannelSpin{50};

// Polls while *word == expected for at most `budget`, yielding the core between rounds of 64
// looks; whether the word changed.
inline bool SpinWhileEquals(const std::atomic<uint32_t>* word, uint32_t expected,
                            std::chrono::microseconds budget) {
  if (budget <= std::chrono::microseconds::zero()) return false;
  const auto until = std::chrono::steady_clock::now() + budget;
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (word->load(std::memory_order_acquire) != expected) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    if (std::chrono::steady_clock::now() >= until) return false;
    // Let a runnable thread (the one that will answer, on a host with fewer free cores than
    // waiters) have this core between looks.
    sched_yield();
  }
}

}  // namespace moe

#endif  // MOE_SERVER_COMMON_SHM_CHANNEL_LAYOUT_H_
