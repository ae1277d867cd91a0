// The CUDA (sm_90a) expert backend behind ExpertBackend: MXFP4 and NVFP4 weights are repacked and
// kept on the device per layer (PrepareLayer); each Run copies the batch (hidden states, local
// ids, top-k weights, shared mask) to the device, runs the expert kernels (expert_kernels.h; as a
// CUDA graph for shapes seen before) and copies the F32/BF16 output back. Host memory registered
// with RegisterHostMemory (pinned and mapped) is read and written in place, and hidden states and
// output in device memory (DeviceForTensors: the backend's device) by device copies. RunParts
// takes a merged batch's rows where they lie in registered memory (copy kernels gather and scatter
// them). Results are bitwise repeatable run to run, graph or not.
//
// Called by CreateBackend("cuda") and tests. Thread-safety and ownership as ExpertBackend: Run and
// RunParts from up to CudaBackendOptions::concurrent_runs threads at once (more wait for a lane);
// device copies of the layers are owned by the instance.
// No CUDA headers here, so the factory can be linked into CPU-only builds (where it reports
// FAILED_PRECONDITION "built without CUDA").
#ifndef MOE_KERNELS_CUDA_CUDA_BACKEND_H_
#define MOE_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace moe {

struct CudaBackendOptions {
  int device = 0;
  // Fill intermediate device buffers with NaN before every Run (tests: unwritten elements show).
  bool poison_scratch = false;
  // Host threads that repack weights in PrepareLayer; 0 = hardware concurrency.
  int upload_threads = 0;
  // GEMM kernel variant (expert_kernels.h GemmLaunch::variant); tests cover all. -1: chosen per
  // batch (kAutoGemmVariant, ExpertRunner::set_gemm_variant).
  int gemm_variant = -1;
  // Direct routes for batches where no expert has two routes (ExpertRunner::set_direct_routes).
  bool direct_routes = true;
  // The wgmma kernel runs both GEMMs when the busiest expert slot of a batch has at least this
  // many tokens (ExpertRunner::set_wgmma_min_tokens); 0 never, -1 the runner's default.
  int wgmma_min_tokens = -1;
  // L2 prefetch bits of the bulk-copy GEMM variants (ExpertRunner::set_l2_prefetch); -1: chosen
  // per batch. Hints only (tests cover them).
  int l2_prefetch = -1;
  // Fold the combine into GEMM2 with grouped routes too (ExpertRunner::set_fold_grouped).
  bool fold_grouped = false;
  // wgmma batches: BF16 hidden rows read in place and y in BF16 (ExpertRunner::set_hidden_in_place,
  // set_y_bf16; false: both off, the staged copy and F32 y), and the L2 prefetch of the next
  // tile's weights (ExpertRunner::set_wgmma_l2_ahead). Tests cover every form.
  bool wgmma_byte_savers = true;
  bool wgmma_l2_ahead = false;
  // wgmma batches: persistent CTAs per width class (ExpertRunner::set_wgmma_persistent: -1 where
  // measured faster (NVFP4 layers), 1 always, 0 never). Tests cover each.
  int wgmma_persistent = -1;
  // Direct-route batches (e.g. one token) with the variant chosen per batch may run GEMM1, GEMM2
  // and the combine as one fused layer kernel (ExpertRunner::set_fused_layer: -1 where it
  // measured faster, i.e. long GEMM1 K and many weight bytes per SM, as DeepSeek-V3's layer at
  // one token; 1 whenever it fits; 0 never). Tests cover each.
  int fused_layer = -1;
  // Two-grid batches on the mma.sync kernels: GEMM2's CTAs start per item as soon as GEMM1's
  // warps of that item are done, not after the whole GEMM1 grid (ExpertRunner::set_item_ready:
  // -1 where it measured faster, GEMM1 grids of 0.8 to 4.5 waves; 1 always; 0 never).
  int item_ready = -1;
  // MXFP4 batches of one token group: the block scale on the fp32 accumulators instead of the
  // decoded weights (ExpertRunner::set_acc_scale; off: measured no faster). Tests cover both.
  bool acc_scale = false;
  // Batches of up to this many tokens run their kernels as a CUDA graph: the second batch of a
  // shape (ExpertRunner::ShapeKey, with the item grid rounded up by at most 1/8) captures one,
  // later ones replay it, so a Run costs one graph launch instead of three or four kernel
  // launches. That pays at one token (H200, problem C: 35.3 vs 41.9 us per Run) and, with
  // programmatic launch inside the graph and the copy kernels in it, at 8 tokens (A 8 132.1 vs
  // 138.8 us, C 8 66.5 vs 72.2) and 64 (1-3.5%). The limit stops at 8 because a server's larger
  // batches come in many shapes (token count x rounded item grid), each an eager Run and a
  // capture before its graph pays, for at most kMaxCudaGraphs kept graphs (least recently used
  // goes; NOTES-cuda.md). 0: never.
  int graph_max_tokens = 8;
  // Programmatic dependent launch between the kernels of a batch (ExpertRunner::
  // set_programmatic_launch).
  bool programmatic_launch = true;
  // Graphs captured with programmatic dependent launch as well (when programmatic_launch is on).
  bool graph_programmatic_launch = true;
  // Inputs and output of batches of up to this many bytes in all go through one pinned host
  // buffer: the host copies into and out of it run on copy_threads threads, then one
  // host-to-device and one device-to-host copy per Run, instead of one pageable copy per tensor
  // (which the driver stages on one thread). Larger batches copy each tensor from and to the
  // caller's memory. 0: never.
  int64_t pinned_staging_bytes = int64_t{256} << 20;
  // Pinned batches of up to this many bytes in all move between the pinned buffer and the device
  // by a copy kernel (the SMs read and write the mapped host memory) instead of the copy engine,
  // inside the batch's graph when it has one. On the H200 machine a one-token batch's two
  // copy-engine transfers took ~12 us of device time, the two copy kernels ~4 us; a Run at A 1
  // 44.5 against 50.1 us, C 2 44.7 against 51.1, A 64 483.7 against 489.2 (NOTES-cuda.md).
  // 0: never.
  int64_t kernel_copy_max_bytes = int64_t{4} << 20;
  // Graphed batches moved by copy kernels: the kernels write the output straight into the mapped
  // pinned buffer (each element once, over PCIe) instead of a copy kernel moving it there after
  // them. false: the copy kernel. Tests cover both.
  bool pinned_direct_output = true;
  // Host threads of the copies into and out of the pinned buffer (tensors of 256 KB and more are
  // split between them); 0: min(8, hardware concurrency).
  int copy_threads = 0;
  // RegisterHostMemory pins (cudaHostRegister) at most this many bytes in all; a registration
  // past it is refused and that memory is staged as any other. 0: none.
  int64_t max_registered_bytes = int64_t{16} << 30;
  // Eager pinned batches whose hidden states (or output) of at least this many bytes lie in
  // registered host memory move them straight between it and the device (the copy engine), not
  // through the pinned buffer: the host copy into (out of) it is skipped. Smaller ones stay
  // staged (a second transfer costs more than their copy), as do graphed batches (their graphs
  // read the pinned buffer).
  int64_t registered_direct_min_bytes = int64_t{256} << 10;
  // Eager batches moved by copy kernels (kernel_copy_max_bytes) whose hidden states (or output)
  // under registered_direct_min_bytes lie in registered host memory at 16-byte aligned addresses:
  // the copy kernels read (write) that memory themselves, mapped into the device's address space,
  // so the host copy into (out of) the pinned buffer is skipped. false: those stay staged.
  bool registered_kernel_copies = true;
  // Runs that may overlap (1..kMaxConcurrentCudaRuns): each of that many lanes has its own
  // stream, device arena, pinned buffer, scratch and graphs, and the layers' device copies are
  // shared. With two, one batch's host work (checks, route plan, copies in, launches) and its wait
  // for the output overlap another batch's kernels; a shard's executor runs that many batches at
  // once (ExpertBackend::MaxConcurrentRuns). 1: one Run at a time, as before.
  int concurrent_runs = 2;
  // Tests only: every graph capture fails, as a failed instantiation would (the batch then runs
  // eagerly, and so does its shape from then on).
  bool test_fail_graph_capture = false;
};

// Graphs a CUDA backend keeps per lane (CudaBackendOptions::graph_max_tokens).
inline constexpr int kMaxCudaGraphs = 64;
// The most lanes a CUDA backend takes (CudaBackendOptions::concurrent_runs).
inline constexpr int kMaxConcurrentCudaRuns = 8;

// How a CUDA backend ran its batches so far (tests and benchmarks): kernels launched one by one,
// graphs captured (each also runs its batch) and graph replays.
struct CudaBackendCounters {
  int64_t eager_runs = 0;
  int64_t graph_captures = 0;
  int64_t graph_replays = 0;
  int64_t pinned_runs = 0;  // Runs whose copies went through the pinned buffer
  int64_t kernel_copy_runs = 0;  // of those, moved by copy kernels (kernel_copy_max_bytes)
  int64_t capture_failures = 0;  // captures that failed (those batches ran eagerly)
  // Batches run eagerly instead of captured because every kept graph was in use (a full cache
  // whose least recently used graph ran within the last 4 x kMaxCudaGraphs graphed Runs).
  int64_t graph_refusals = 0;
  // Times the kept graphs were dropped because what they point at moved: a larger device arena,
  // pinned buffer or runner scratch, or a new layer copy.
  int64_t graph_invalidations = 0;
  // Runs whose hidden states or output moved straight from or to registered host memory
  // (CudaBackendOptions::registered_direct_min_bytes), and the bytes registered now.
  int64_t direct_runs = 0;
  int64_t registered_bytes = 0;
  // Of the direct Runs, those whose registered hidden states or output the copy kernels read or
  // wrote in place (CudaBackendOptions::registered_kernel_copies).
  int64_t mapped_runs = 0;
  // Of those, RunParts batches whose rows the copy kernels gathered and scattered in place.
  int64_t parts_runs = 0;
  // Runs whose hidden states or output were device memory (ExpertsRequest::hidden_on_device,
  // out_on_device; counted in direct_runs too), and of those, Runs whose kernels read or wrote
  // one of them in place (256-byte aligned: no copy).
  int64_t device_tensor_runs = 0;
  int64_t in_place_runs = 0;
  // Runs that took their lane while another Run held one (CudaBackendOptions::concurrent_runs).
  int64_t overlapped_runs = 0;
  // Fused layer kernels enqueued (eager runs and captures; replays launch what they captured).
  int64_t fused_layer_launches = 0;
  // GEMM2 launches that waited per item (ExpertGemmParams::item_ready; eager runs and captures).
  int64_t item_ready_launches = 0;
  // Host time of each step of the Runs so far, summed in nanoseconds (benchmarks: where a Run's
  // time beyond the device's goes): checks, route plan and buffers; the input copies (host copy
  // into the pinned buffer and the copy submission); the kernels' launch (one graph or the
  // launches); the output copy's submission; the wait for the device; the host copy out of the
  // pinned buffer.
  int64_t prepare_ns = 0;
  int64_t copy_in_ns = 0;
  int64_t enqueue_ns = 0;
  int64_t copy_out_submit_ns = 0;
  int64_t wait_ns = 0;
  int64_t copy_out_host_ns = 0;
};
// The counters of `backend` when it is a CUDA backend, else all zero.
CudaBackendCounters GetCudaBackendCounters(const ExpertBackend& backend);

// FAILED_PRECONDITION with the reason when the binary has no CUDA or no device is present.
absl::StatusOr<std::unique_ptr<ExpertBackend>> MakeCudaExpertBackend(
    const CudaBackendOptions& options = {});

}  // namespace moe

#endif  // MOE_KERNELS_CUDA_CUDA_BACKEND_H_
