// Autograd ops of relu_pool and the fused branch
// (pytorch/kcla_branch_autograd.cpp), called by kcla_mm/ops/kcla_branch.py's
// relu_pool and kcla_branch, which document the arguments.
#ifndef KCLA_BRANCH_AUTOGRAD_HPP
#define KCLA_BRANCH_AUTOGRAD_HPP
#include <torch/extension.h>

#include <vector>

// (x, pooled): s = ReLU(s + residual) in place and its GAP.
std::vector<at::Tensor> kcla_relu_pool_autograd(
    at::Tensor s, c10::optional<at::Tensor> residual, py::object handoff,
    bool grad_in_place);

// (out, u_next) of the branch, followed with z_floor by the growth check's
// (flag, floor_out) (kcla_state_growth_impl).
std::vector<at::Tensor> kcla_branch_autograd(
    at::Tensor x, c10::optional<at::Tensor> u, at::Tensor w, at::Tensor z,
    at::Tensor gate, at::Tensor weight, at::Tensor bn_weight,
    at::Tensor bn_bias, at::Tensor keep,
    c10::optional<at::Tensor> running_mean,
    c10::optional<at::Tensor> running_var, c10::optional<double> momentum,
    bool use_batch_stats, bool one_call, double bn_eps, double eps,
    py::object tape_in, py::object tape_out, bool out_in_place,
    py::object x_handoff, c10::optional<at::Tensor> z_floor,
    double growth_limit);
#endif  // KCLA_BRANCH_AUTOGRAD_HPP
