// Bulk copies (cp.async.bulk, sm_90) into shared memory completed on mbarriers, and L2 cache
// policies: shared by the expert GEMM kernels (weight rings) and the NVFP4 staging kernel (row
// stages). Device code only; included by .cu files.
#ifndef MOE_KERNELS_CUDA_BULK_COPY_CUH_
#define MOE_KERNELS_CUDA_BULK_COPY_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::cuda::detail {

// Bulk copies (cp.async.bulk, sm_90: one request for a whole contiguous range, done by the
// copy engine) into shared memory, completed on an mbarrier (transaction bytes), and L2 hints.
// Addresses and sizes: multiples of 16 bytes.
__device__ __forceinline__ void MbarrierInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized barriers visible to the copy engine (async proxy).
__device__ __forceinline__ void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also announces `bytes` of copies to complete on the barrier.
__device__ __forceinline__ void MbarrierArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the barrier's phase with the given parity has completed.
__device__ __forceinline__ void MbarrierWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void BulkCopyToShared(uint32_t smem, const void* p, uint32_t bytes,
                                                 uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem),
      "l"(p), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void BulkPrefetchL2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// L2 policy for every line an access touches: evict first (read once) or normal.
__device__ __forceinline__ uint64_t L2Policy(bool evict_first) {
  uint64_t first, normal;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
  asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(normal));
  return evict_first ? first : normal;
}

}  // namespace moe::cuda::detail

#endif  // MOE_KERNELS_CUDA_BULK_COPY_CUH_
