// The CPU branch kernels built for AVX2 + FMA, with the lane-group kernels
// for small planes (KCLA_CPU_LANES, kcla_branch_lanes.hpp); kcla_branch.cpp
// picks them at run time on CPUs that have both. Every header is included
// before the target pragma, so only kcla_branch_kernels.hpp's own code (in
// its own namespace) is compiled for AVX2.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "kcla_branch_cpu.hpp"
#include "kcla_head_math.hpp"
#include "pytorch_cpp_helper.hpp"

#ifdef KCLA_CPU_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define KCLA_CPU_NS kcla_cpu_avx2
#define KCLA_CPU_LANES
#include "kcla_branch_kernels.hpp"
#undef KCLA_CPU_LANES
#undef KCLA_CPU_NS
#pragma GCC pop_options

BranchKernels avx2_branch_kernels() { return kcla_cpu_avx2::kernels(); }
#endif
