// CPU launchers of the fused KCLA branch: the kernels of
// kcla_branch_kernels.hpp, or their AVX2 + FMA copy where the CPU has both
// (the environment variable KCLA_CPU_ISA=base forces the baseline copy).
#include <cstdlib>
#include <cstring>
#include <string>

#define KCLA_CPU_NS kcla_cpu_base
#include "kcla_branch_kernels.hpp"
#undef KCLA_CPU_NS
#include "pytorch_device_registry.hpp"

namespace {

bool use_avx2() {
#ifdef KCLA_CPU_AVX2
  const char* isa = std::getenv("KCLA_CPU_ISA");
  if (isa != nullptr && std::strcmp(isa, "base") == 0) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

const BranchKernels& cpu_kernels() {
  static const BranchKernels kernels =
      use_avx2() ? avx2_branch_kernels() : kcla_cpu_base::kernels();
  return kernels;
}

}  // namespace

std::string kcla_cpu_isa() { return use_avx2() ? "avx2" : "base"; }

REGISTER_DEVICE_IMPL(kcla_relu_pool_forward_impl, CPU,
                     cpu_kernels().relu_pool_forward);
REGISTER_DEVICE_IMPL(kcla_relu_pool_backward_impl, CPU,
                     cpu_kernels().relu_pool_backward);
REGISTER_DEVICE_IMPL(kcla_branch_stats_impl, CPU, cpu_kernels().branch_stats);
REGISTER_DEVICE_IMPL(kcla_branch_forward_impl, CPU,
                     cpu_kernels().branch_forward);
REGISTER_DEVICE_IMPL(kcla_branch_apply_impl, CPU, cpu_kernels().branch_apply);
REGISTER_DEVICE_IMPL(kcla_branch_bn_sums_impl, CPU,
                     cpu_kernels().branch_bn_sums);
REGISTER_DEVICE_IMPL(kcla_branch_backward_impl, CPU,
                     cpu_kernels().branch_backward);
REGISTER_DEVICE_IMPL(kcla_branch_train_forward_impl, CPU,
                     cpu_kernels().branch_train_forward);
REGISTER_DEVICE_IMPL(kcla_branch_train_backward_impl, CPU,
                     cpu_kernels().branch_train_backward);
REGISTER_DEVICE_IMPL(kcla_layer_inference_impl, CPU,
                     cpu_kernels().layer_inference);
REGISTER_DEVICE_IMPL(kcla_heads_forward_impl, CPU, cpu_kernels().heads_forward);
REGISTER_DEVICE_IMPL(kcla_heads_backward_impl, CPU,
                     cpu_kernels().heads_backward);
REGISTER_DEVICE_IMPL(kcla_adapter_inference_impl, CPU,
                     cpu_kernels().adapter_inference);
