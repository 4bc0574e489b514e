// Declarations of the fused KCLA branch ops (spec section 2, steps 4-8).
//
// Shapes: x, u, u_next, o, out and their gradients: (B, C, H, W)
// contiguous; w, z, gate: (B, G) with G dividing C (head g owns channels
// [g * C / G, (g + 1) * C / G)); weight: (C, 1, 3, 3), the depthwise conv;
// scale, shift: (C,), the folded BN; keep: (B,), drop-path multipliers;
// mask: (B, C, ceil(H * W / 8)) uint8, the ReLU's decisions, bit i % 8 of
// byte i / 8 for position i of a plane (backward uses the exact forward
// decisions, even where o is recomputed from a state recovered by inversion).
//
//   u_next = u + w * x                       (u undefined: w * x)
//   o      = gate * DWConv3x3(u_next / (z + eps))
//   out    = x + keep * ReLU(scale * o + shift)
#ifndef KCLA_BRANCH_IMPL_HPP
#define KCLA_BRANCH_IMPL_HPP
#include <torch/extension.h>

// u_next and o from (x, u); one pass per (b, c) plane.
void kcla_branch_forward_impl(const at::Tensor x, const at::Tensor u,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              at::Tensor u_next, at::Tensor o, double eps);

// out = x + keep * ReLU(scale * o + shift); mask = [scale * o + shift > 0].
void kcla_bn_relu_add_forward_impl(const at::Tensor o, const at::Tensor x,
                                   const at::Tensor scale,
                                   const at::Tensor shift,
                                   const at::Tensor keep, at::Tensor out,
                                   at::Tensor mask);

// o = gate * DWConv3x3(u_next / (z + eps)) again (backward recompute).
void kcla_branch_recompute_impl(const at::Tensor u_next, const at::Tensor z,
                                const at::Tensor gate, const at::Tensor weight,
                                at::Tensor o, double eps);

// Backward of out = x + keep * ReLU(scale * o + shift) with scale, shift
// held constant: g_n = grad_out * keep * mask,
// grad_o = scale * g_n; sum_grad[c] = sum g_n and
// sum_grad_centered[c] = sum g_n * (o - mean[c]) (centred: no cancellation
// when |mean| >> std).
void kcla_bn_relu_add_backward_impl(const at::Tensor grad_out,
                                    const at::Tensor o, const at::Tensor scale,
                                    const at::Tensor mask,
                                    const at::Tensor keep,
                                    const at::Tensor mean, at::Tensor grad_o,
                                    at::Tensor sum_grad,
                                    at::Tensor sum_grad_centered);

// Gradients of kcla_branch_forward. The gradient reaching o is
// grad_o + alpha[c] + beta[c] * (o - mean[c]) (the affine term carries BN's
// batch statistics in training; zeros in eval). grad_x also receives
// grad_residual (the gradient reaching x directly); grad_u is undefined
// when u was.
void kcla_branch_backward_impl(
    const at::Tensor grad_o, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, const at::Tensor grad_u_next, const at::Tensor grad_residual,
    const at::Tensor x, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    at::Tensor grad_x, at::Tensor grad_u, at::Tensor grad_w, at::Tensor grad_z,
    at::Tensor grad_gate, at::Tensor grad_weight, double eps);

// Inference: u_next = u + w * x (u_next may alias u: in place);
// out = x + ReLU(scale * gate * DWConv3x3(u_next / (z + eps)) + shift),
// one pass per plane.
void kcla_branch_inference_impl(const at::Tensor x, const at::Tensor u,
                                const at::Tensor w, const at::Tensor z,
                                const at::Tensor gate, const at::Tensor weight,
                                const at::Tensor scale, const at::Tensor shift,
                                at::Tensor u_next, at::Tensor out, double eps);

// Python-facing entries (pytorch/kcla_branch.cpp): check, then dispatch.
void kcla_branch_forward(const at::Tensor x, const c10::optional<at::Tensor> u,
                         const at::Tensor w, const at::Tensor z,
                         const at::Tensor gate, const at::Tensor weight,
                         at::Tensor u_next, at::Tensor o, double eps);
void kcla_branch_recompute(const at::Tensor u_next, const at::Tensor z,
                           const at::Tensor gate, const at::Tensor weight,
                           at::Tensor o, double eps);
void kcla_bn_relu_add_forward(const at::Tensor o, const at::Tensor x,
                              const at::Tensor scale, const at::Tensor shift,
                              const at::Tensor keep, at::Tensor out,
                              at::Tensor mask);
void kcla_bn_relu_add_backward(const at::Tensor grad_out, const at::Tensor o,
                               const at::Tensor scale, const at::Tensor mask,
                               const at::Tensor keep, const at::Tensor mean,
                               at::Tensor grad_o, at::Tensor sum_grad,
                               at::Tensor sum_grad_centered);
void kcla_branch_backward(
    const at::Tensor grad_o, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, const at::Tensor grad_u_next, const at::Tensor grad_residual,
    const at::Tensor x, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    at::Tensor grad_x, const c10::optional<at::Tensor> grad_u,
    at::Tensor grad_w, at::Tensor grad_z, at::Tensor grad_gate,
    at::Tensor grad_weight, double eps);
void kcla_branch_inference(const at::Tensor x,
                           const c10::optional<at::Tensor> u,
                           const at::Tensor w, const at::Tensor z,
                           const at::Tensor gate, const at::Tensor weight,
                           const at::Tensor scale, const at::Tensor shift,
                           at::Tensor u_next, at::Tensor out, double eps);

#endif  // KCLA_BRANCH_IMPL_HPP
