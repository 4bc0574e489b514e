// The CPU branch kernels as a table of *_impl-typed function pointers, one
// table per ISA copy of kcla_branch_kernels.hpp.
#ifndef KCLA_BRANCH_CPU_HPP
#define KCLA_BRANCH_CPU_HPP
#include "kcla_branch_impl.hpp"

struct BranchKernels {
  decltype(&kcla_relu_pool_forward_impl) relu_pool_forward;
  decltype(&kcla_relu_pool_backward_impl) relu_pool_backward;
  decltype(&kcla_branch_stats_impl) branch_stats;
  decltype(&kcla_branch_forward_impl) branch_forward;
  decltype(&kcla_branch_apply_impl) branch_apply;
  decltype(&kcla_branch_bn_sums_impl) branch_bn_sums;
  decltype(&kcla_branch_backward_impl) branch_backward;
  decltype(&kcla_branch_train_forward_impl) branch_train_forward;
  decltype(&kcla_branch_train_backward_impl) branch_train_backward;
  decltype(&kcla_layer_inference_impl) layer_inference;
  decltype(&kcla_heads_forward_impl) heads_forward;
  decltype(&kcla_heads_backward_impl) heads_backward;
  decltype(&kcla_adapter_inference_impl) adapter_inference;
};

#if defined(__GNUC__) && defined(__x86_64__)
#define KCLA_CPU_AVX2 1
// The copy built for AVX2 + FMA (kcla_branch_avx2.cpp).
BranchKernels avx2_branch_kernels();
#endif

#endif  // KCLA_BRANCH_CPU_HPP
