// The CPU reference backend: RunExpertsReference behind the ExpertBackend interface. Scalar and
// exact; the oracle for every other backend and the embedded default until the optimized CPU
// backend lands. Thread-safety and ownership as ExpertBackend.
#ifndef MOE_KERNELS_CPU_REFERENCE_BACKEND_H_
#define MOE_KERNELS_CPU_REFERENCE_BACKEND_H_

#include <memory>

#include "kernels/backend.h"

namespace moe {

std::unique_ptr<ExpertBackend> MakeCpuReferenceBackend();

}  // namespace moe

#endif  // MOE_KERNELS_CPU_REFERENCE_BACKEND_H_
