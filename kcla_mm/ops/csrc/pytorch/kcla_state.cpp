// Op entries of the KCLA state update: argument checks, then dispatch to the
// tensors' device.
#include "kcla_state_impl.hpp"
#include "pytorch_cpp_helper.hpp"
#include "pytorch_device_registry.hpp"

void kcla_state_forward_impl(const at::Tensor x, const at::Tensor u,
                             const at::Tensor w, const at::Tensor z,
                             at::Tensor u_next, at::Tensor agg, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_state_forward_impl, x, u, w, z, u_next, agg, eps);
}

void kcla_state_backward_impl(const at::Tensor grad_u_next,
                              const at::Tensor grad_agg, const at::Tensor x,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor agg, at::Tensor grad_x,
                              at::Tensor grad_u, at::Tensor grad_w,
                              at::Tensor grad_z, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_state_backward_impl, grad_u_next, grad_agg, x, w,
                       z, agg, grad_x, grad_u, grad_w, grad_z, eps);
}

void kcla_state_growth_impl(const at::Tensor z, const at::Tensor floor,
                            at::Tensor floor_out, at::Tensor flag,
                            double limit) {
  DISPATCH_DEVICE_IMPL(kcla_state_growth_impl, z, floor, floor_out, flag,
                       limit);
}

void kcla_state_forward(const at::Tensor x, const c10::optional<at::Tensor> u,
                        const at::Tensor w, const at::Tensor z,
                        at::Tensor u_next, at::Tensor agg, double eps) {
  FeatureArgChecker ck("kcla_state_forward", x, w, /*any_float=*/true);
  const at::Tensor u_t = u.value_or(at::Tensor());
  ck.map(u_t, "u");
  ck.heads(z, "z");
  ck.map(u_next, "u_next");
  ck.map(agg, "agg");
  kcla_state_forward_impl(x, u_t, w, z, u_next, agg, eps);
}

void kcla_state_backward(const at::Tensor grad_u_next,
                         const at::Tensor grad_agg, const at::Tensor x,
                         const at::Tensor w, const at::Tensor z,
                         const at::Tensor agg, at::Tensor grad_x,
                         const c10::optional<at::Tensor> grad_u,
                         at::Tensor grad_w, at::Tensor grad_z, double eps) {
  FeatureArgChecker ck("kcla_state_backward", x, w, /*any_float=*/true);
  ck.heads(z, "z");
  ck.map(grad_u_next, "grad_u_next");
  ck.map(grad_agg, "grad_agg");
  ck.map(agg, "agg");
  ck.map(grad_x, "grad_x");
  const at::Tensor grad_u_t = grad_u.value_or(at::Tensor());
  ck.map(grad_u_t, "grad_u");
  ck.heads(grad_w, "grad_w");
  ck.heads(grad_z, "grad_z");
  kcla_state_backward_impl(grad_u_next, grad_agg, x, w, z, agg, grad_x,
                           grad_u_t, grad_w, grad_z, eps);
}
