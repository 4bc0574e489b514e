// Device-independent declarations of the KCLA state op (docs/method.md §2,
// steps 4-5).
// Declared once here; pytorch/kcla_state.cpp dispatches them, the device
// files register their launchers for them.
//
// Shapes: x, u, u_next, agg: (B, C, H, W) contiguous; w, z: (B, G) with
// C % G == 0. Head g of sample b covers the contiguous chunk of
// L = (C / G) * H * W elements starting at (b * G + g) * L.
//   u_next = u + w * x        (u undefined: u_next = w * x)
//   agg    = u_next / (z + eps)
#ifndef KCLA_STATE_IMPL_HPP
#define KCLA_STATE_IMPL_HPP
#include <torch/extension.h>

void kcla_state_forward_impl(const at::Tensor x, const at::Tensor u,
                             const at::Tensor w, const at::Tensor z,
                             at::Tensor u_next, at::Tensor agg, double eps);

// grad_u is undefined when u was; grad_w and grad_z are (B, G).
void kcla_state_backward_impl(const at::Tensor grad_u_next,
                              const at::Tensor grad_agg, const at::Tensor x,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor agg, at::Tensor grad_x,
                              at::Tensor grad_u, at::Tensor grad_w,
                              at::Tensor grad_z, double eps);

// The state inversion's growth check (kcla_mm/ops/kcla_branch.py), on the
// device: flag (a bool scalar) = any(z > limit * floor) and floor_out =
// flag ? z : floor; z, floor, floor_out (B, G) contiguous, one dtype.
void kcla_state_growth_impl(const at::Tensor z, const at::Tensor floor,
                            at::Tensor floor_out, at::Tensor flag,
                            double limit);

// Python-facing entries (pytorch/kcla_state.cpp): check, then dispatch.
// u and grad_u are optional (None for the first layer of a state).
void kcla_state_forward(const at::Tensor x, const c10::optional<at::Tensor> u,
                        const at::Tensor w, const at::Tensor z,
                        at::Tensor u_next, at::Tensor agg, double eps);
void kcla_state_backward(const at::Tensor grad_u_next,
                         const at::Tensor grad_agg, const at::Tensor x,
                         const at::Tensor w, const at::Tensor z,
                         const at::Tensor agg, at::Tensor grad_x,
                         const c10::optional<at::Tensor> grad_u,
                         at::Tensor grad_w, at::Tensor grad_z, double eps);

#endif  // KCLA_STATE_IMPL_HPP
