// Parameter sets of the expert-layer sweep tests: one struct for a case, the combination sweep
// (every weight format x gate/up layout x activation, the other axes cycling through a list of
// shapes) and gtest's case names. Shared by kernels/experts_test.cc (the reference against
// hand-built numerics) and kernels/cpu/cpu_backend_test.cc (the optimized CPU backend against the
// reference).
//
// Test-only. Plain values.
#ifndef MOE_KERNELS_SWEEP_CASES_H_
#define MOE_KERNELS_SWEEP_CASES_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/experts.h"

namespace moe::sweep {

struct SweepCase {
  std::string name;
  WeightFormat format;
  GateUpLayout layout;
  ActivationKind act;
  int64_t tokens, experts, k, hidden, inter;
  bool bias;
  int shared;  // number of shared experts; a mask is sent whenever there are any
  DType in_dtype, out_dtype;
};

void PrintTo(const SweepCase& c, std::ostream* os);

struct SweepDims {
  int64_t tokens, experts, k, hidden, inter;
};

// Every format x layout x activation (30 cases); case i takes dims[i % dims.size()], a bias when
// i is even, i % 3 shared experts, F32 input when i % 4 < 2 and F32 output when i % 5 < 3 (else
// BF16).
std::vector<SweepCase> ComboCases(const std::vector<SweepDims>& dims);

// gtest's name of a case: its name with every non-alphanumeric character replaced by '_'.
std::string SweepCaseName(const testing::TestParamInfo<SweepCase>& info);

}  // namespace moe::sweep

#endif  // MOE_KERNELS_SWEEP_CASES_H_
