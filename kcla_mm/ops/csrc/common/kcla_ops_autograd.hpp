// Autograd ops of the KCLA heads and the state update
// (pytorch/kcla_ops_autograd.cpp), called by kcla_mm/ops/kcla_heads.py's
// kcla_heads and kcla_mm/ops/kcla_state.py's kcla_state_update, which
// document the arguments.
#ifndef KCLA_OPS_AUTOGRAD_HPP
#define KCLA_OPS_AUTOGRAD_HPP
#include <torch/extension.h>

#include <vector>

// (w, z_next, gate), each (B, G).
std::vector<at::Tensor> kcla_heads_autograd(
    at::Tensor pooled, c10::optional<at::Tensor> z, at::Tensor q_kernel,
    at::Tensor k_kernel, at::Tensor norm_d, at::Tensor gate_weight,
    double key_eps, double max_log_weight);

// (u_next, agg), each (B, C, H, W).
std::vector<at::Tensor> kcla_state_autograd(at::Tensor x,
                                            c10::optional<at::Tensor> u,
                                            at::Tensor w, at::Tensor z,
                                            double eps);
#endif  // KCLA_OPS_AUTOGRAD_HPP
