// The cross-stage adapter's per-head scalars in training (docs/method.md
// §3, Algorithm 1): the small part of kcla_mm/ops/kcla_adapter.py's
// kcla_adapter, between the batched matmuls it runs in ATen.
//
// Per sample b and adapter group g (G groups = the layer's heads; ci input
// and co output channels per group, C = G * co), from the strided incoming
// state's GAP um (B, G, ci), its centred Gram matrix cov = Uc Uc^T (B, G,
// ci, ci, batch statistics only), the incoming Z (B, Gi) and the grouped
// 1x1 conv weight (G, co, ci) (undefined: identity, co = ci):
//   W_b   = weight / Z per input channel          y = W_b um  (GAP(Y))
//   mean, var of Y per channel: the batch's (cov / hw, y) or the running
//   k     = bn_weight / sqrt(var + bn_eps)        pooled = k (y - mean) + bn_bias
//   z     = exp(min(|Conv1d_u(pooled)_g| / norm_d_g, max_log))
//   mat   = z k W_b (B, G, co, ci)
//   bias  = z pooled (batch statistics; the caller's U is centred) or
//           z (pooled - k y) (running statistics; the raw U)
// so that U' = mat @ U + bias. With batch statistics and a running mean,
// the running statistics are updated as nn.BatchNorm2d does (momentum < 0:
// not updated).
#ifndef KCLA_ADAPTER_IMPL_HPP
#define KCLA_ADAPTER_IMPL_HPP
#include <torch/extension.h>

#include <vector>

struct AdapterHeads {
  at::Tensor um, cov, z_in, weight, bn_weight, bn_bias, running_mean,
      running_var, k_kernel, norm_d;
  int64_t hw;
  bool batch_stats;
  double momentum, bn_eps, max_log;
};

// Forward outputs; aux (3, B, G, co) holds y, pooled and the key, bn_stats
// (2, G, co) the mean and 1 / sqrt(var + bn_eps) used: backward reads both.
struct AdapterHeadsOut {
  at::Tensor mat, bias, z_out, aux, bn_stats;
};

// Backward: from the gradients of mat, bias and z_out (grad_z undefined:
// none), the gradient of U for U' = mat @ U + bias is mat^T @ grad_U' +
// s @ U + r (s (B, G, ci, ci), batch statistics only: cov's term; r (B,
// G, ci): the GAP's and the centring's terms), with the gradients of z_in,
// weight (when defined), bn_weight, bn_bias and k_kernel.
struct AdapterHeadsGrads {
  at::Tensor grad_mat, grad_bias, grad_z;
  at::Tensor r, s, grad_z_in, grad_weight, grad_bn_weight, grad_bn_bias,
      grad_k_kernel;
};

void kcla_adapter_heads_forward_impl(const at::Tensor um,
                                     const AdapterHeads& a,
                                     const AdapterHeadsOut& out);
void kcla_adapter_heads_backward_impl(const at::Tensor um,
                                      const AdapterHeads& a,
                                      const AdapterHeadsOut& saved,
                                      const AdapterHeadsGrads& g);

// The adapter as an autograd op (pytorch/kcla_adapter.cpp): U (B, C', H',
// W') and Z (B, Gi) -> (U' (B, C, h, w), z (B, G)), G = norm_d's
// elements, the conv `weight` (C, C' / G, 1, 1) or undefined (identity),
// at `stride`; running statistics updated with `momentum` (< 0: not) when
// `batch_stats`. kcla_mm/ops/kcla_adapter.py documents it.
std::vector<at::Tensor> kcla_adapter_autograd(
    at::Tensor u, at::Tensor z, c10::optional<at::Tensor> weight,
    at::Tensor bn_weight, at::Tensor bn_bias,
    c10::optional<at::Tensor> running_mean,
    c10::optional<at::Tensor> running_var, at::Tensor k_kernel,
    at::Tensor norm_d, int64_t stride, bool batch_stats, double momentum,
    double bn_eps, double max_log_weight);
#endif  // KCLA_ADAPTER_IMPL_HPP
