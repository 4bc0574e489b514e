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

namespace {
constexpr const char* kForward = "kcla_state_forward";
constexpr const char* kBackward = "kcla_state_backward";

// x: (B, C, H, W); w, z: (B, G) with C % G == 0; others like x.
void check_state_args(const char* op, const at::Tensor& x,
                      const at::Tensor& w, const at::Tensor& z) {
  check_contiguous(x, op, "x");
  check_contiguous(w, op, "w");
  check_contiguous(z, op, "z");
  TORCH_CHECK(x.dim() == 4, op, ": argument `x` must be 4-D (B, C, H, W), got ",
              x.sizes());
  TORCH_CHECK(w.dim() == 2 && w.size(0) == x.size(0) && w.size(1) > 0 &&
                  x.size(1) % w.size(1) == 0,
              op, ": argument `w` must be (B, G) with B = ", x.size(0),
              " and G dividing C = ", x.size(1), ", got ", w.sizes());
  TORCH_CHECK(z.sizes() == w.sizes(), op, ": argument `z` must have the shape ",
              "of `w` ", w.sizes(), ", got ", z.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op,
              ": argument `x` must be floating point, got ", x.scalar_type());
  check_same_device_dtype(w, "w", x, "x", op);
  check_same_device_dtype(z, "z", x, "x", op);
}

void check_like(const char* op, const at::Tensor& t, const char* name,
                const at::Tensor& ref, const char* ref_name) {
  check_contiguous(t, op, name);
  check_same_device_dtype(t, name, ref, ref_name, op);
  TORCH_CHECK(t.sizes() == ref.sizes(), op, ": argument `", name,
              "` must have the shape of `", ref_name, "` ", ref.sizes(),
              ", got ", t.sizes());
}
}  // namespace

void kcla_state_forward(const at::Tensor x, const c10::optional<at::Tensor> u,
                        const at::Tensor w, const at::Tensor z,
                        at::Tensor u_next, at::Tensor agg, double eps) {
  check_state_args(kForward, x, w, z);
  at::Tensor u_t = u.value_or(at::Tensor());
  if (u_t.defined()) check_like(kForward, u_t, "u", x, "x");
  check_like(kForward, u_next, "u_next", x, "x");
  check_like(kForward, agg, "agg", x, "x");
  kcla_state_forward_impl(x, u_t, w, z, u_next, agg, eps);
}

void kcla_state_backward(const at::Tensor grad_u_next,
                         const at::Tensor grad_agg, const at::Tensor x,
                         const at::Tensor w, const at::Tensor z,
                         const at::Tensor agg, at::Tensor grad_x,
                         const c10::optional<at::Tensor> grad_u,
                         at::Tensor grad_w, at::Tensor grad_z, double eps) {
  check_state_args(kBackward, x, w, z);
  check_like(kBackward, grad_u_next, "grad_u_next", x, "x");
  check_like(kBackward, grad_agg, "grad_agg", x, "x");
  check_like(kBackward, agg, "agg", x, "x");
  check_like(kBackward, grad_x, "grad_x", x, "x");
  at::Tensor grad_u_t = grad_u.value_or(at::Tensor());
  if (grad_u_t.defined()) check_like(kBackward, grad_u_t, "grad_u", x, "x");
  check_like(kBackward, grad_w, "grad_w", w, "w");
  check_like(kBackward, grad_z, "grad_z", w, "w");
  kcla_state_backward_impl(grad_u_next, grad_agg, x, w, z, agg, grad_x,
                           grad_u_t, grad_w, grad_z, eps);
}
