// Declarations of the fused KCLA branch ops (docs/method.md §2, steps 4-8),
// with the block's final ReLU and KCLA's GAP folded in.
//
// Shapes: s, x, u, u_next, u_prev, out and their gradients: (B, C, H, W)
// contiguous; w, z, gate: (B, G) with G dividing C (head g owns channels
// [g * C / G, (g + 1) * C / G)); weight: (C, 1, 3, 3), the depthwise conv;
// scale, shift, alpha, beta, mean: (C,); keep: (B,), drop-path multipliers;
// pooled: (B, C); per-plane partial sums: (B, C, k); masks: (B, C,
// ceil(H * W / 8)) uint8, bit i % 8 of byte i / 8 for position i of a plane.
//
//   x      = ReLU(s + r)                      (in place, kcla_relu_pool)
//   u_next = u + w * x                        (u undefined: w * x)
//   o      = gate * DWConv3x3(u_next / (z + eps))
//   out    = x + keep * ReLU(scale * o + shift)
//
// Training saves out (the next block's conv keeps it anyway), u_next (or
// nothing, when the next layer inverts the running sum) and two bit masks;
// backward recomputes o from u_next and recovers x = out - keep * ReLU(.).
#ifndef KCLA_BRANCH_IMPL_HPP
#define KCLA_BRANCH_IMPL_HPP
#include <torch/extension.h>

#include <string>

// s = ReLU(s + residual) in place (residual optional: the block's shortcut,
// so the residual add is fused too); mask (optional) = [s > 0]; pooled =
// mean of s over H, W.
void kcla_relu_pool_forward_impl(at::Tensor s, const at::Tensor residual,
                                 at::Tensor mask, at::Tensor pooled);

// grad_s = mask * (grad_x + grad_pooled / (H * W)).
void kcla_relu_pool_backward_impl(const at::Tensor grad_x,
                                  const at::Tensor grad_pooled,
                                  const at::Tensor mask, at::Tensor grad_s);

// u_next, and stats[b, c] = (mean, sum of squared deviations) of o over the
// plane (BN's batch statistics are combined from them).
void kcla_branch_stats_impl(const at::Tensor x, const at::Tensor u,
                            const at::Tensor w, const at::Tensor z,
                            const at::Tensor gate, const at::Tensor weight,
                            at::Tensor u_next, at::Tensor stats, double eps);

// The whole branch in one pass: u_next (may alias u) and out (may alias x);
// keep undefined = 1; mask (optional) = [scale * o + shift > 0].
void kcla_branch_forward_impl(const at::Tensor x, const at::Tensor u,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              const at::Tensor scale, const at::Tensor shift,
                              const at::Tensor keep, at::Tensor u_next,
                              at::Tensor out, at::Tensor mask, double eps);

// out (may alias x) and mask from an already updated u_next (second pass
// after kcla_branch_stats).
void kcla_branch_apply_impl(const at::Tensor x, const at::Tensor u_next,
                            const at::Tensor z, const at::Tensor gate,
                            const at::Tensor weight, const at::Tensor scale,
                            const at::Tensor shift, const at::Tensor keep,
                            at::Tensor out, at::Tensor mask, double eps);

// bn_sums[b, c] = (sum g, sum g * (o - mean[c])) over the plane, with
// g = grad_out * keep * mask: BN's batch-statistics terms for backward.
void kcla_branch_bn_sums_impl(const at::Tensor grad_out,
                              const at::Tensor u_next, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              const at::Tensor keep, const at::Tensor mask,
                              const at::Tensor mean, at::Tensor bn_sums,
                              double eps);

// Gradients of the branch. The gradient reaching o is
// scale * g + alpha[c] + beta[c] * (o - mean[c]) (alpha, beta carry BN's
// batch statistics; zeros with running statistics). grad_x = grad_out +
// w * grad_u (the ReLU of s is kcla_relu_pool's). Per-plane partials:
// bn_sums as kcla_branch_bn_sums; head_sums = (d/dw, d/dz, d/dgate);
// weight_sums = d/dweight (9 taps). grad_u_next and grad_u are optional;
// u_prev (optional, may alias u_next) = u_next - w * x inverts the state.
void kcla_branch_backward_impl(
    const at::Tensor grad_out, const at::Tensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, at::Tensor grad_x, at::Tensor grad_u,
    at::Tensor u_prev, at::Tensor bn_sums, at::Tensor head_sums,
    at::Tensor weight_sums, double eps);

// The training forward with BN's batch statistics in one call (what
// kcla_branch_stats, the statistics' fold and kcla_branch_apply do, the
// conv computed once): u_next (may alias u), out (may alias x), mask;
// mean, invstd (C,): the batch statistics; scale, shift (C,): BN folded
// with bn_weight, bn_bias (C,). running_mean, running_var (C,) optional
// (both or neither): updated as nn.BatchNorm2d does with `momentum` (the
// unbiased variance).
void kcla_branch_train_forward_impl(
    const at::Tensor x, const at::Tensor u, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor bn_weight, const at::Tensor bn_bias,
    at::Tensor running_mean, at::Tensor running_var, const at::Tensor keep,
    at::Tensor u_next, at::Tensor out, at::Tensor mask, at::Tensor mean,
    at::Tensor invstd, at::Tensor scale, at::Tensor shift, double momentum,
    double bn_eps, double eps);
// The whole training backward in one call (what kcla_branch_bn_sums, BN's
// gradient terms, kcla_branch_backward and the sums over batch and heads
// do): grad_x, grad_u and u_prev as kcla_branch_backward; grad_w, grad_z,
// grad_gate (B, G); grad_weight (C, 1, 3, 3); grad_bn_weight, grad_bn_bias
// (C,). batch_stats: BN ran with batch statistics (mean, invstd of the
// batch), else with running ones (alpha = beta = 0).
void kcla_branch_train_backward_impl(
    const at::Tensor grad_out, const at::Tensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor mean, const at::Tensor invstd,
    at::Tensor grad_x, at::Tensor grad_u, at::Tensor u_prev,
    at::Tensor grad_w, at::Tensor grad_z, at::Tensor grad_gate,
    at::Tensor grad_weight, at::Tensor grad_bn_weight,
    at::Tensor grad_bn_bias, bool batch_stats, double eps);
// A whole KCLALayer in inference (keep = 1), with two eval BNs given by
// their parameters and running statistics and folded here (BN(v) = scale *
// v + shift, scale = weight / sqrt(var + eps)):
//   x = ReLU(tail BN(s) + residual)   (in place over s; the block's last
//       BN (tail_weight, tail_bias, tail_mean, tail_var, tail_eps) and its
//       shortcut, both optional)
//   Q, K = Conv1d_q, Conv1d_k (GAP(x)) with the odd-length kernels
//       q_kernel, k_kernel (k elements), zero padding (k - 1) / 2, viewed
//       (B, G, d)
//   w = exp(min(|K_g| / norm_d_g, max_log_weight)); z_next = z + w (z
//       undefined: w); gate = sigmoid(gate_weight @ rel), rel_g = <Q_g,
//       K_g> / max(|K_g|, key_eps); norm_d (G elements), gate_weight (G, G)
//   then kcla_branch_forward with the branch BN (bn_weight, bn_bias,
//       bn_mean, bn_var, bn_eps): u_next (may alias u) and out over s.
// w, z_next, gate: (B, G) outputs. The operands beside s travel as one
// struct, its fields checked by the entry (kcla_layer_inference).
struct LayerInferenceOperands {
  at::Tensor residual, tail_weight, tail_bias, tail_mean, tail_var, u, z,
      q_kernel, k_kernel, norm_d, gate_weight, weight, bn_weight, bn_bias,
      bn_mean, bn_var, u_next, w, z_next, gate;
  double eps, key_eps, max_log_weight, bn_eps, tail_eps;
};
void kcla_layer_inference_impl(at::Tensor s,
                               const LayerInferenceOperands& a);

// KCLALayer's heads (steps 1-3 above) from pooled (B, C): w, z_next, gate
// (B, G) outputs, z (B, G) optional. The backward takes grad_w (that of w
// plus that of z_next) and grad_gate, and writes grad_pooled (B, C) and the
// gradients of the two kernels (k,) and of gate_weight (G, G).
void kcla_heads_forward_impl(const at::Tensor pooled, const at::Tensor z,
                             const at::Tensor q_kernel,
                             const at::Tensor k_kernel,
                             const at::Tensor norm_d,
                             const at::Tensor gate_weight, at::Tensor w,
                             at::Tensor z_next, at::Tensor gate,
                             double key_eps, double max_log_weight);
void kcla_heads_backward_impl(
    const at::Tensor pooled, const at::Tensor q_kernel,
    const at::Tensor k_kernel, const at::Tensor norm_d,
    const at::Tensor gate_weight, const at::Tensor w, const at::Tensor gate,
    const at::Tensor grad_w, const at::Tensor grad_gate,
    at::Tensor grad_pooled, at::Tensor grad_q_kernel,
    at::Tensor grad_k_kernel, at::Tensor grad_gate_weight, double key_eps,
    double max_log_weight);

// KCLAStateAdapter in inference (docs/method.md §3, Algorithm 1), its eval BN
// (bn_weight, bn_bias, bn_mean, bn_var, bn_eps) folded: from the incoming
// state u (B, C', H', W'), z (B, G') with G' dividing C', the new state
//   A'    = BN(Conv1x1(U / Z)), the grouped (G groups) 1x1 conv `weight`
//           (C, C' / G) at `stride` (u at stride s: (B, C', h, w), h =
//           ceil(H' / s), w = ceil(W' / s))
//   z_out = exp(min(|Conv1d_u(GAP(A'))_g| / norm_d_g, max_log_weight)),
//           k_kernel (k elements, odd), norm_d (G elements)
//   u_out = z_out * A'                       (B, C, h, w)
// z_out: (B, G) output, G dividing C and C'.
void kcla_adapter_inference_impl(
    const at::Tensor u, const at::Tensor z, const at::Tensor weight,
    int64_t stride, const at::Tensor bn_weight, const at::Tensor bn_bias,
    const at::Tensor bn_mean, const at::Tensor bn_var,
    const at::Tensor k_kernel, const at::Tensor norm_d, at::Tensor u_out,
    at::Tensor z_out, double bn_eps, double max_log_weight);

// The instruction set the CPU kernels run with: "avx2" or "base"
// (pytorch/cpu/kcla_branch.cpp).
std::string kcla_cpu_isa();

// Python-facing entries (pytorch/kcla_branch.cpp): check, then dispatch.
using OptTensor = c10::optional<at::Tensor>;
void kcla_relu_pool_forward(at::Tensor s, const OptTensor residual,
                            const OptTensor mask, at::Tensor pooled);
void kcla_relu_pool_backward(const at::Tensor grad_x,
                             const at::Tensor grad_pooled,
                             const at::Tensor mask, at::Tensor grad_s);
void kcla_branch_stats(const at::Tensor x, const OptTensor u,
                       const at::Tensor w, const at::Tensor z,
                       const at::Tensor gate, const at::Tensor weight,
                       at::Tensor u_next, at::Tensor stats, double eps);
void kcla_branch_forward(const at::Tensor x, const OptTensor u,
                         const at::Tensor w, const at::Tensor z,
                         const at::Tensor gate, const at::Tensor weight,
                         const at::Tensor scale, const at::Tensor shift,
                         const OptTensor keep, at::Tensor u_next,
                         at::Tensor out, const OptTensor mask, double eps);
void kcla_branch_apply(const at::Tensor x, const at::Tensor u_next,
                       const at::Tensor z, const at::Tensor gate,
                       const at::Tensor weight, const at::Tensor scale,
                       const at::Tensor shift, const at::Tensor keep,
                       at::Tensor out, at::Tensor mask, double eps);
void kcla_branch_bn_sums(const at::Tensor grad_out, const at::Tensor u_next,
                         const at::Tensor z, const at::Tensor gate,
                         const at::Tensor weight, const at::Tensor keep,
                         const at::Tensor mask, const at::Tensor mean,
                         at::Tensor bn_sums, double eps);
void kcla_branch_backward(
    const at::Tensor grad_out, const OptTensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, at::Tensor grad_x, const OptTensor grad_u,
    const OptTensor u_prev, at::Tensor bn_sums, at::Tensor head_sums,
    at::Tensor weight_sums, double eps);

void kcla_branch_train_forward(
    const at::Tensor x, const OptTensor u, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor bn_weight, const at::Tensor bn_bias,
    const OptTensor running_mean, const OptTensor running_var,
    const at::Tensor keep, at::Tensor u_next, at::Tensor out,
    at::Tensor mask, at::Tensor mean, at::Tensor invstd, at::Tensor scale,
    at::Tensor shift, double momentum, double bn_eps, double eps);
void kcla_branch_train_backward(
    const at::Tensor grad_out, const OptTensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor mean, const at::Tensor invstd,
    at::Tensor grad_x, const OptTensor grad_u, const OptTensor u_prev,
    at::Tensor grad_w, at::Tensor grad_z, at::Tensor grad_gate,
    at::Tensor grad_weight, at::Tensor grad_bn_weight,
    at::Tensor grad_bn_bias, bool batch_stats, double eps);
void kcla_layer_inference(
    at::Tensor s, const OptTensor residual, const OptTensor tail_weight,
    const OptTensor tail_bias, const OptTensor tail_mean,
    const OptTensor tail_var, const OptTensor u, const OptTensor z,
    const at::Tensor q_kernel, const at::Tensor k_kernel,
    const at::Tensor norm_d, const at::Tensor gate_weight,
    const at::Tensor weight, const at::Tensor bn_weight,
    const at::Tensor bn_bias, const at::Tensor bn_mean,
    const at::Tensor bn_var, at::Tensor u_next, at::Tensor w,
    at::Tensor z_next, at::Tensor gate, double eps, double key_eps,
    double max_log_weight, double bn_eps, double tail_eps);
void kcla_heads_forward(const at::Tensor pooled, const OptTensor z,
                        const at::Tensor q_kernel, const at::Tensor k_kernel,
                        const at::Tensor norm_d, const at::Tensor gate_weight,
                        at::Tensor w, at::Tensor z_next, at::Tensor gate,
                        double key_eps, double max_log_weight);
void kcla_heads_backward(
    const at::Tensor pooled, const at::Tensor q_kernel,
    const at::Tensor k_kernel, const at::Tensor norm_d,
    const at::Tensor gate_weight, const at::Tensor w, const at::Tensor gate,
    const at::Tensor grad_w, const at::Tensor grad_gate,
    at::Tensor grad_pooled, at::Tensor grad_q_kernel,
    at::Tensor grad_k_kernel, at::Tensor grad_gate_weight, double key_eps,
    double max_log_weight);
void kcla_adapter_inference(
    const at::Tensor u, const at::Tensor z, const at::Tensor weight,
    int64_t stride, const at::Tensor bn_weight, const at::Tensor bn_bias,
    const at::Tensor bn_mean, const at::Tensor bn_var,
    const at::Tensor k_kernel, const at::Tensor norm_d, at::Tensor u_out,
    at::Tensor z_out, double bn_eps, double max_log_weight);

#endif  // KCLA_BRANCH_IMPL_HPP
