// The gated-activation epilogue of the CPU expert GEMMs (a GatedFn, fp4_gemm.h): act(gate, up)
// for the activation kinds of kernels/activation.h, with the same fp32 formulas as the reference.
//
// Called from the GEMM kernels of every instruction set through a function pointer, so that this
// code is compiled once, for the baseline ISA. Pure: thread-safe.
#ifndef MOE_KERNELS_CPU_GATED_ACTIVATION_H_
#define MOE_KERNELS_CPU_GATED_ACTIVATION_H_

namespace moe::cpu {

// out[i] = ApplyActivation(*static_cast<const ActivationParams*>(ctx), gate[i], up[i]), i < n.
void GatedActivation(const void* ctx, const float* gate, const float* up, int n, float* out);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_GATED_ACTIVATION_H_
