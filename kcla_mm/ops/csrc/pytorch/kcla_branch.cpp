// Op entries of the fused KCLA branch: argument checks, then dispatch.
#include "kcla_branch_impl.hpp"
#include "pytorch_cpp_helper.hpp"
#include "pytorch_device_registry.hpp"

void kcla_branch_forward_impl(const at::Tensor x, const at::Tensor u,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              at::Tensor u_next, at::Tensor o, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_forward_impl, x, u, w, z, gate, weight,
                       u_next, o, eps);
}

void kcla_branch_recompute_impl(const at::Tensor u_next, const at::Tensor z,
                                const at::Tensor gate, const at::Tensor weight,
                                at::Tensor o, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_recompute_impl, u_next, z, gate, weight, o,
                       eps);
}

void kcla_bn_relu_add_forward_impl(const at::Tensor o, const at::Tensor x,
                                   const at::Tensor scale,
                                   const at::Tensor shift,
                                   const at::Tensor keep, at::Tensor out,
                                   at::Tensor mask) {
  DISPATCH_DEVICE_IMPL(kcla_bn_relu_add_forward_impl, o, x, scale, shift, keep,
                       out, mask);
}

void kcla_bn_relu_add_backward_impl(const at::Tensor grad_out,
                                    const at::Tensor o, const at::Tensor scale,
                                    const at::Tensor mask,
                                    const at::Tensor keep,
                                    const at::Tensor mean, at::Tensor grad_o,
                                    at::Tensor sum_grad,
                                    at::Tensor sum_grad_centered) {
  DISPATCH_DEVICE_IMPL(kcla_bn_relu_add_backward_impl, grad_out, o, scale,
                       mask, keep, mean, grad_o, sum_grad, sum_grad_centered);
}

void kcla_branch_backward_impl(
    const at::Tensor grad_o, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, const at::Tensor grad_u_next,
    const at::Tensor grad_residual, const at::Tensor x,
    const at::Tensor u_next, const at::Tensor w, const at::Tensor z,
    const at::Tensor gate, const at::Tensor weight, at::Tensor grad_x,
    at::Tensor grad_u, at::Tensor grad_w, at::Tensor grad_z,
    at::Tensor grad_gate, at::Tensor grad_weight, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_backward_impl, grad_o, alpha, beta, mean,
                       grad_u_next, grad_residual, x, u_next, w, z, gate,
                       weight, grad_x, grad_u, grad_w, grad_z, grad_gate,
                       grad_weight, eps);
}

void kcla_branch_inference_impl(const at::Tensor x, const at::Tensor u,
                                const at::Tensor w, const at::Tensor z,
                                const at::Tensor gate, const at::Tensor weight,
                                const at::Tensor scale, const at::Tensor shift,
                                at::Tensor u_next, at::Tensor out, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_inference_impl, x, u, w, z, gate, weight,
                       scale, shift, u_next, out, eps);
}

namespace {

at::Tensor optional_tensor(const c10::optional<at::Tensor>& t) {
  return t.value_or(at::Tensor());
}

}  // namespace

void kcla_branch_forward(const at::Tensor x, const c10::optional<at::Tensor> u,
                         const at::Tensor w, const at::Tensor z,
                         const at::Tensor gate, const at::Tensor weight,
                         at::Tensor u_next, at::Tensor o, double eps) {
  FeatureArgChecker ck("kcla_branch_forward", x, w);
  const at::Tensor u_t = optional_tensor(u);
  ck.map(u_t, "u");
  ck.heads(z, "z");
  ck.heads(gate, "gate");
  ck.kernel(weight, "weight");
  ck.map(u_next, "u_next");
  ck.map(o, "o");
  kcla_branch_forward_impl(x, u_t, w, z, gate, weight, u_next, o, eps);
}

void kcla_branch_recompute(const at::Tensor u_next, const at::Tensor z,
                           const at::Tensor gate, const at::Tensor weight,
                           at::Tensor o, double eps) {
  FeatureArgChecker ck("kcla_branch_recompute", u_next, z);
  ck.heads(gate, "gate");
  ck.kernel(weight, "weight");
  ck.map(o, "o");
  kcla_branch_recompute_impl(u_next, z, gate, weight, o, eps);
}

void kcla_bn_relu_add_forward(const at::Tensor o, const at::Tensor x,
                              const at::Tensor scale, const at::Tensor shift,
                              const at::Tensor keep, at::Tensor out,
                              at::Tensor mask) {
  FeatureArgChecker ck("kcla_bn_relu_add_forward", x);
  ck.map(o, "o");
  ck.channels(scale, "scale");
  ck.channels(shift, "shift");
  ck.batch(keep, "keep");
  ck.map(out, "out");
  ck.relu_mask(mask, "mask");
  kcla_bn_relu_add_forward_impl(o, x, scale, shift, keep, out, mask);
}

void kcla_bn_relu_add_backward(const at::Tensor grad_out, const at::Tensor o,
                               const at::Tensor scale, const at::Tensor mask,
                               const at::Tensor keep, const at::Tensor mean,
                               at::Tensor grad_o, at::Tensor sum_grad,
                               at::Tensor sum_grad_centered) {
  FeatureArgChecker ck("kcla_bn_relu_add_backward", o);
  ck.map(grad_out, "grad_out");
  ck.channels(scale, "scale");
  ck.relu_mask(mask, "mask");
  ck.batch(keep, "keep");
  ck.channels(mean, "mean");
  ck.map(grad_o, "grad_o");
  ck.channels(sum_grad, "sum_grad");
  ck.channels(sum_grad_centered, "sum_grad_centered");
  kcla_bn_relu_add_backward_impl(grad_out, o, scale, mask, keep, mean,
                                 grad_o, sum_grad, sum_grad_centered);
}

void kcla_branch_backward(
    const at::Tensor grad_o, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, const at::Tensor grad_u_next, const at::Tensor grad_residual,
    const at::Tensor x, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    at::Tensor grad_x, const c10::optional<at::Tensor> grad_u,
    at::Tensor grad_w, at::Tensor grad_z, at::Tensor grad_gate,
    at::Tensor grad_weight, double eps) {
  FeatureArgChecker ck("kcla_branch_backward", x, w);
  ck.map(grad_o, "grad_o");
  ck.channels(alpha, "alpha");
  ck.channels(beta, "beta");
  ck.channels(mean, "mean");
  ck.map(grad_u_next, "grad_u_next");
  ck.map(grad_residual, "grad_residual");
  ck.map(u_next, "u_next");
  ck.heads(z, "z");
  ck.heads(gate, "gate");
  ck.kernel(weight, "weight");
  ck.map(grad_x, "grad_x");
  const at::Tensor grad_u_t = optional_tensor(grad_u);
  ck.map(grad_u_t, "grad_u");
  ck.heads(grad_w, "grad_w");
  ck.heads(grad_z, "grad_z");
  ck.heads(grad_gate, "grad_gate");
  ck.kernel(grad_weight, "grad_weight");
  kcla_branch_backward_impl(grad_o, alpha, beta, mean, grad_u_next,
                            grad_residual,
                            x, u_next, w, z, gate, weight, grad_x, grad_u_t,
                            grad_w, grad_z, grad_gate, grad_weight, eps);
}

void kcla_branch_inference(const at::Tensor x,
                           const c10::optional<at::Tensor> u,
                           const at::Tensor w, const at::Tensor z,
                           const at::Tensor gate, const at::Tensor weight,
                           const at::Tensor scale, const at::Tensor shift,
                           at::Tensor u_next, at::Tensor out, double eps) {
  FeatureArgChecker ck("kcla_branch_inference", x, w);
  const at::Tensor u_t = optional_tensor(u);
  ck.map(u_t, "u");
  ck.heads(z, "z");
  ck.heads(gate, "gate");
  ck.kernel(weight, "weight");
  ck.channels(scale, "scale");
  ck.channels(shift, "shift");
  ck.map(u_next, "u_next");
  ck.map(out, "out");
  kcla_branch_inference_impl(x, u_t, w, z, gate, weight, scale, shift, u_next,
                             out, eps);
}
