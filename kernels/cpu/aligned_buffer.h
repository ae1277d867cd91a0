// Cache-line aligned std::vector storage for packed weights and kernel workspaces: vector loads
// of packed rows never straddle a line and never fault on an unaligned aligned-load.
//
// Used by the CPU kernels and backend. Thread-safety and ownership as std::vector.
#ifndef MOE_KERNELS_CPU_ALIGNED_BUFFER_H_
#define MOE_KERNELS_CPU_ALIGNED_BUFFER_H_

#include <cstddef>
#include <new>
#include <vector>

namespace moe::cpu {

inline constexpr size_t kCacheLine = 64;

template <typename T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}  // NOLINT(runtime/explicit): rebinding

  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kCacheLine)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(kCacheLine)); }

  template <typename U>
  bool operator==(const AlignedAllocator<U>&) const {
    return true;
  }
};

template <typename T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_ALIGNED_BUFFER_H_
