// Op entries of the fused KCLA branch: argument checks, then dispatch.
#include "kcla_branch_impl.hpp"
#include "pytorch_cpp_helper.hpp"
#include "pytorch_device_registry.hpp"

void kcla_relu_pool_forward_impl(at::Tensor s, const at::Tensor residual,
                                 at::Tensor mask, at::Tensor pooled) {
  DISPATCH_DEVICE_IMPL(kcla_relu_pool_forward_impl, s, residual, mask,
                       pooled);
}

void kcla_relu_pool_backward_impl(const at::Tensor grad_x,
                                  const at::Tensor grad_pooled,
                                  const at::Tensor mask, at::Tensor grad_s) {
  DISPATCH_DEVICE_IMPL(kcla_relu_pool_backward_impl, grad_x, grad_pooled,
                       mask, grad_s);
}

void kcla_branch_stats_impl(const at::Tensor x, const at::Tensor u,
                            const at::Tensor w, const at::Tensor z,
                            const at::Tensor gate, const at::Tensor weight,
                            at::Tensor u_next, at::Tensor stats, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_stats_impl, x, u, w, z, gate, weight,
                       u_next, stats, eps);
}

void kcla_branch_forward_impl(const at::Tensor x, const at::Tensor u,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              const at::Tensor scale, const at::Tensor shift,
                              const at::Tensor keep, at::Tensor u_next,
                              at::Tensor out, at::Tensor mask, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_forward_impl, x, u, w, z, gate, weight,
                       scale, shift, keep, u_next, out, mask, eps);
}

void kcla_branch_apply_impl(const at::Tensor x, const at::Tensor u_next,
                            const at::Tensor z, const at::Tensor gate,
                            const at::Tensor weight, const at::Tensor scale,
                            const at::Tensor shift, const at::Tensor keep,
                            at::Tensor out, at::Tensor mask, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_apply_impl, x, u_next, z, gate, weight,
                       scale, shift, keep, out, mask, eps);
}

void kcla_branch_bn_sums_impl(const at::Tensor grad_out,
                              const at::Tensor u_next, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              const at::Tensor keep, const at::Tensor mask,
                              const at::Tensor mean, at::Tensor bn_sums,
                              double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_bn_sums_impl, grad_out, u_next, z, gate,
                       weight, keep, mask, mean, bn_sums, eps);
}

void kcla_branch_backward_impl(
    const at::Tensor grad_out, const at::Tensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, at::Tensor grad_x, at::Tensor grad_u,
    at::Tensor u_prev, at::Tensor bn_sums, at::Tensor head_sums,
    at::Tensor weight_sums, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_backward_impl, grad_out, grad_u_next, out,
                       u_next, w, z, gate, weight, scale, shift, keep, mask,
                       alpha, beta, mean, grad_x, grad_u, u_prev, bn_sums,
                       head_sums, weight_sums, eps);
}

namespace {

at::Tensor optional_tensor(const OptTensor& t) {
  return t.value_or(at::Tensor());
}

// The per-head and per-channel arguments shared by the branch entries.
void check_branch_args(const FeatureArgChecker& ck, const at::Tensor& z,
                       const at::Tensor& gate, const at::Tensor& weight) {
  ck.heads(z, "z");
  ck.heads(gate, "gate");
  ck.kernel(weight, "weight");
}

// keep may be undefined only where the op allows it (inference).
void check_bn_args(const FeatureArgChecker& ck, const at::Tensor& scale,
                   const at::Tensor& shift, const at::Tensor& keep,
                   bool keep_optional = false) {
  ck.channels(scale, "scale");
  ck.channels(shift, "shift");
  if (keep.defined() || !keep_optional) ck.batch(keep, "keep");
}

}  // namespace

void kcla_relu_pool_forward(at::Tensor s, const OptTensor residual,
                            const OptTensor mask, at::Tensor pooled) {
  FeatureArgChecker ck("kcla_relu_pool_forward", s, at::Tensor(), false, "s");
  const at::Tensor residual_t = optional_tensor(residual);
  if (residual_t.defined()) ck.map(residual_t, "residual");
  const at::Tensor mask_t = optional_tensor(mask);
  if (mask_t.defined()) ck.relu_mask(mask_t, "mask");
  ck.planes(pooled, "pooled");
  kcla_relu_pool_forward_impl(s, residual_t, mask_t, pooled);
}

void kcla_relu_pool_backward(const at::Tensor grad_x,
                             const at::Tensor grad_pooled,
                             const at::Tensor mask, at::Tensor grad_s) {
  FeatureArgChecker ck("kcla_relu_pool_backward", grad_x, at::Tensor(), false,
                        "grad_x");
  ck.planes(grad_pooled, "grad_pooled");
  ck.relu_mask(mask, "mask");
  ck.map(grad_s, "grad_s");
  kcla_relu_pool_backward_impl(grad_x, grad_pooled, mask, grad_s);
}

void kcla_branch_stats(const at::Tensor x, const OptTensor u,
                       const at::Tensor w, const at::Tensor z,
                       const at::Tensor gate, const at::Tensor weight,
                       at::Tensor u_next, at::Tensor stats, double eps) {
  FeatureArgChecker ck("kcla_branch_stats", x, w);
  const at::Tensor u_t = optional_tensor(u);
  ck.map(u_t, "u");
  check_branch_args(ck, z, gate, weight);
  ck.map(u_next, "u_next");
  ck.planes(stats, "stats", 2);
  kcla_branch_stats_impl(x, u_t, w, z, gate, weight, u_next, stats, eps);
}

void kcla_branch_forward(const at::Tensor x, const OptTensor u,
                         const at::Tensor w, const at::Tensor z,
                         const at::Tensor gate, const at::Tensor weight,
                         const at::Tensor scale, const at::Tensor shift,
                         const OptTensor keep, at::Tensor u_next,
                         at::Tensor out, const OptTensor mask, double eps) {
  FeatureArgChecker ck("kcla_branch_forward", x, w);
  const at::Tensor u_t = optional_tensor(u), keep_t = optional_tensor(keep);
  const at::Tensor mask_t = optional_tensor(mask);
  ck.map(u_t, "u");
  check_branch_args(ck, z, gate, weight);
  check_bn_args(ck, scale, shift, keep_t, /*keep_optional=*/true);
  ck.map(u_next, "u_next");
  ck.map(out, "out");
  if (mask_t.defined()) ck.relu_mask(mask_t, "mask");
  kcla_branch_forward_impl(x, u_t, w, z, gate, weight, scale, shift, keep_t,
                           u_next, out, mask_t, eps);
}

void kcla_branch_apply(const at::Tensor x, const at::Tensor u_next,
                       const at::Tensor z, const at::Tensor gate,
                       const at::Tensor weight, const at::Tensor scale,
                       const at::Tensor shift, const at::Tensor keep,
                       at::Tensor out, at::Tensor mask, double eps) {
  FeatureArgChecker ck("kcla_branch_apply", x, z, false, "x", "z");
  ck.map(u_next, "u_next");
  check_branch_args(ck, z, gate, weight);
  check_bn_args(ck, scale, shift, keep);
  ck.map(out, "out");
  ck.relu_mask(mask, "mask");
  kcla_branch_apply_impl(x, u_next, z, gate, weight, scale, shift, keep, out,
                         mask, eps);
}

void kcla_branch_bn_sums(const at::Tensor grad_out, const at::Tensor u_next,
                         const at::Tensor z, const at::Tensor gate,
                         const at::Tensor weight, const at::Tensor keep,
                         const at::Tensor mask, const at::Tensor mean,
                         at::Tensor bn_sums, double eps) {
  FeatureArgChecker ck("kcla_branch_bn_sums", u_next, z, false, "u_next",
                        "z");
  ck.map(grad_out, "grad_out");
  check_branch_args(ck, z, gate, weight);
  ck.batch(keep, "keep");
  ck.relu_mask(mask, "mask");
  ck.channels(mean, "mean");
  ck.planes(bn_sums, "bn_sums", 2);
  kcla_branch_bn_sums_impl(grad_out, u_next, z, gate, weight, keep, mask,
                           mean, bn_sums, eps);
}

void kcla_branch_backward(
    const at::Tensor grad_out, const OptTensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, at::Tensor grad_x, const OptTensor grad_u,
    const OptTensor u_prev, at::Tensor bn_sums, at::Tensor head_sums,
    at::Tensor weight_sums, double eps) {
  FeatureArgChecker ck("kcla_branch_backward", out, w, false, "out");
  const at::Tensor grad_u_next_t = optional_tensor(grad_u_next);
  const at::Tensor grad_u_t = optional_tensor(grad_u);
  const at::Tensor u_prev_t = optional_tensor(u_prev);
  ck.map(grad_out, "grad_out");
  ck.map(grad_u_next_t, "grad_u_next");
  ck.map(u_next, "u_next");
  check_branch_args(ck, z, gate, weight);
  check_bn_args(ck, scale, shift, keep);
  ck.relu_mask(mask, "mask");
  ck.channels(alpha, "alpha");
  ck.channels(beta, "beta");
  ck.channels(mean, "mean");
  ck.map(grad_x, "grad_x");
  ck.map(grad_u_t, "grad_u");
  ck.map(u_prev_t, "u_prev");
  ck.planes(bn_sums, "bn_sums", 2);
  ck.planes(head_sums, "head_sums", 3);
  ck.planes(weight_sums, "weight_sums", 9);
  kcla_branch_backward_impl(grad_out, grad_u_next_t, out, u_next, w, z, gate,
                            weight, scale, shift, keep, mask, alpha, beta,
                            mean, grad_x, grad_u_t, u_prev_t, bn_sums,
                            head_sums, weight_sums, eps);
}
