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

void kcla_branch_train_forward_impl(
    const at::Tensor x, const at::Tensor u, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor bn_weight, const at::Tensor bn_bias,
    at::Tensor running_mean, at::Tensor running_var, const at::Tensor keep,
    at::Tensor u_next, at::Tensor out, at::Tensor mask, at::Tensor mean,
    at::Tensor invstd, at::Tensor scale, at::Tensor shift, double momentum,
    double bn_eps, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_train_forward_impl, x, u, w, z, gate,
                       weight, bn_weight, bn_bias, running_mean, running_var,
                       keep, u_next, out, mask, mean, invstd, scale, shift,
                       momentum, bn_eps, eps);
}

void kcla_branch_train_backward_impl(
    const at::Tensor grad_out, const at::Tensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor mean, const at::Tensor invstd,
    at::Tensor grad_x, at::Tensor grad_u, at::Tensor u_prev,
    at::Tensor grad_w, at::Tensor grad_z, at::Tensor grad_gate,
    at::Tensor grad_weight, at::Tensor grad_bn_weight,
    at::Tensor grad_bn_bias, bool batch_stats, double eps) {
  DISPATCH_DEVICE_IMPL(kcla_branch_train_backward_impl, grad_out, grad_u_next,
                       out, u_next, w, z, gate, weight, scale, shift, keep,
                       mask, mean, invstd, grad_x, grad_u, u_prev, grad_w,
                       grad_z, grad_gate, grad_weight, grad_bn_weight,
                       grad_bn_bias, batch_stats, eps);
}

void kcla_layer_inference_impl(at::Tensor s,
                               const LayerInferenceOperands& a) {
  DISPATCH_DEVICE_IMPL(kcla_layer_inference_impl, s, a);
}

void kcla_heads_forward_impl(const at::Tensor pooled, const at::Tensor z,
                             const at::Tensor q_kernel,
                             const at::Tensor k_kernel,
                             const at::Tensor norm_d,
                             const at::Tensor gate_weight, at::Tensor w,
                             at::Tensor z_next, at::Tensor gate,
                             double key_eps, double max_log_weight) {
  DISPATCH_DEVICE_IMPL(kcla_heads_forward_impl, pooled, z, q_kernel,
                       k_kernel, norm_d, gate_weight, w, z_next, gate,
                       key_eps, max_log_weight);
}

void kcla_heads_backward_impl(
    const at::Tensor pooled, const at::Tensor q_kernel,
    const at::Tensor k_kernel, const at::Tensor norm_d,
    const at::Tensor gate_weight, const at::Tensor w, const at::Tensor gate,
    const at::Tensor grad_w, const at::Tensor grad_gate,
    at::Tensor grad_pooled, at::Tensor grad_q_kernel,
    at::Tensor grad_k_kernel, at::Tensor grad_gate_weight, double key_eps,
    double max_log_weight) {
  DISPATCH_DEVICE_IMPL(kcla_heads_backward_impl, pooled, q_kernel, k_kernel,
                       norm_d, gate_weight, w, gate, grad_w, grad_gate,
                       grad_pooled, grad_q_kernel, grad_k_kernel,
                       grad_gate_weight, key_eps, max_log_weight);
}

void kcla_adapter_inference_impl(
    const at::Tensor u, const at::Tensor z, const at::Tensor weight,
    int64_t stride, const at::Tensor bn_weight, const at::Tensor bn_bias,
    const at::Tensor bn_mean, const at::Tensor bn_var,
    const at::Tensor k_kernel, const at::Tensor norm_d, at::Tensor u_out,
    at::Tensor z_out, double bn_eps, double max_log_weight) {
  DISPATCH_DEVICE_IMPL(kcla_adapter_inference_impl, u, z, weight, stride,
                       bn_weight, bn_bias, bn_mean, bn_var, k_kernel, norm_d,
                       u_out, z_out, bn_eps, max_log_weight);
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

// The arguments the two backward entries share (grad_u_next, grad_u and
// u_prev optional: undefined).
void check_backward_args(const FeatureArgChecker& ck,
                         const at::Tensor& grad_out,
                         const at::Tensor& grad_u_next,
                         const at::Tensor& u_next, const at::Tensor& z,
                         const at::Tensor& gate, const at::Tensor& weight,
                         const at::Tensor& scale, const at::Tensor& shift,
                         const at::Tensor& keep, const at::Tensor& mask,
                         const at::Tensor& mean, const at::Tensor& grad_x,
                         const at::Tensor& grad_u,
                         const at::Tensor& u_prev) {
  ck.map(grad_out, "grad_out");
  ck.map(grad_u_next, "grad_u_next");
  ck.map(u_next, "u_next");
  check_branch_args(ck, z, gate, weight);
  check_bn_args(ck, scale, shift, keep);
  ck.relu_mask(mask, "mask");
  ck.channels(mean, "mean");
  ck.map(grad_x, "grad_x");
  ck.map(grad_u, "grad_u");
  ck.map(u_prev, "u_prev");
}

// The heads' parameters, contiguous and of any shape: two ECA kernels of
// one odd number of elements k, norm_d of G elements, gate_weight (G, G),
// on `ref`'s device with its dtype.
void check_head_params(const char* op, const at::Tensor& ref,
                       const char* ref_name, const at::Tensor& q_kernel,
                       const at::Tensor& k_kernel, const at::Tensor& norm_d,
                       const at::Tensor& gate_weight, int64_t G) {
  for (const auto& kernel : {std::make_pair(&q_kernel, "q_kernel"),
                             std::make_pair(&k_kernel, "k_kernel")}) {
    const at::Tensor& t = *kernel.first;
    check_operand(t, op, kernel.second, ref, ref_name);
    TORCH_CHECK(t.numel() % 2 == 1 && t.numel() == q_kernel.numel(), op,
                ": argument `", kernel.second,
                "` must hold an odd number of elements, as many as "
                "`q_kernel` (", q_kernel.numel(), "), got shape ",
                t.sizes());
  }
  check_operand(norm_d, op, "norm_d", ref, ref_name);
  TORCH_CHECK(norm_d.numel() == G, op,
              ": argument `norm_d` must hold G = ", G, " elements, got shape ",
              norm_d.sizes());
  check_operand(gate_weight, op, "gate_weight", ref, ref_name);
  TORCH_CHECK(gate_weight.dim() == 2 && gate_weight.size(0) == G &&
                  gate_weight.size(1) == G,
              op, ": argument `gate_weight` must be (G, G) with G = ", G,
              ", got ", gate_weight.sizes());
}

// pooled (B, C) and the (B, G) per-head tensors of the heads ops.
class HeadArgChecker {
 public:
  HeadArgChecker(const char* op, const at::Tensor& pooled,
                 const at::Tensor& w)
      : op_(op), pooled_(pooled), w_(w) {
    check_contiguous(pooled, op, "pooled");
    TORCH_CHECK(pooled.scalar_type() == at::kFloat ||
                    pooled.scalar_type() == at::kDouble,
                op, ": argument `pooled` must be float32 or float64, got ",
                pooled.scalar_type());
    TORCH_CHECK(pooled.dim() == 2, op,
                ": argument `pooled` must be (B, C), got ", pooled.sizes());
    check_operand(w, op, "w", pooled, "pooled");
    TORCH_CHECK(w.dim() == 2 && w.size(0) == pooled.size(0) &&
                    w.size(1) > 0 && pooled.size(1) % w.size(1) == 0,
                op, ": argument `w` must be (B, G) with B = ", pooled.size(0),
                " and G dividing C = ", pooled.size(1), ", got ", w.sizes());
  }
  void heads(const at::Tensor& t, const char* name) const {
    like(t, w_, name, "w");
  }
  void like(const at::Tensor& t, const at::Tensor& ref, const char* name,
            const char* ref_name) const {
    check_operand(t, op_, name, pooled_, "pooled");
    TORCH_CHECK(t.sizes() == ref.sizes(), op_, ": argument `", name,
                "` must have the shape of `", ref_name, "` ", ref.sizes(),
                ", got ", t.sizes());
  }

 private:
  const char* op_;
  const at::Tensor pooled_;
  const at::Tensor w_;
};

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
  check_backward_args(ck, grad_out, grad_u_next_t, u_next, z, gate, weight,
                      scale, shift, keep, mask, mean, grad_x, grad_u_t,
                      u_prev_t);
  ck.channels(alpha, "alpha");
  ck.channels(beta, "beta");
  ck.planes(bn_sums, "bn_sums", 2);
  ck.planes(head_sums, "head_sums", 3);
  ck.planes(weight_sums, "weight_sums", 9);
  kcla_branch_backward_impl(grad_out, grad_u_next_t, out, u_next, w, z, gate,
                            weight, scale, shift, keep, mask, alpha, beta,
                            mean, grad_x, grad_u_t, u_prev_t, bn_sums,
                            head_sums, weight_sums, eps);
}

void kcla_branch_train_forward(
    const at::Tensor x, const OptTensor u, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor bn_weight, const at::Tensor bn_bias,
    const OptTensor running_mean, const OptTensor running_var,
    const at::Tensor keep, at::Tensor u_next, at::Tensor out,
    at::Tensor mask, at::Tensor mean, at::Tensor invstd, at::Tensor scale,
    at::Tensor shift, double momentum, double bn_eps, double eps) {
  const char* op = "kcla_branch_train_forward";
  FeatureArgChecker ck(op, x, w);
  const at::Tensor u_t = optional_tensor(u);
  const at::Tensor running_mean_t = optional_tensor(running_mean);
  const at::Tensor running_var_t = optional_tensor(running_var);
  ck.map(u_t, "u");
  check_branch_args(ck, z, gate, weight);
  ck.channels(bn_weight, "bn_weight");
  ck.channels(bn_bias, "bn_bias");
  TORCH_CHECK(running_mean_t.defined() == running_var_t.defined(), op,
              ": `running_mean` and `running_var` must be given together");
  if (running_mean_t.defined()) {
    ck.channels(running_mean_t, "running_mean");
    ck.channels(running_var_t, "running_var");
  }
  ck.batch(keep, "keep");
  ck.map(u_next, "u_next");
  ck.map(out, "out");
  ck.relu_mask(mask, "mask");
  for (const auto& t : {std::make_pair(&mean, "mean"),
                        std::make_pair(&invstd, "invstd"),
                        std::make_pair(&scale, "scale"),
                        std::make_pair(&shift, "shift")}) {
    ck.channels(*t.first, t.second);
  }
  kcla_branch_train_forward_impl(x, u_t, w, z, gate, weight, bn_weight,
                                 bn_bias, running_mean_t, running_var_t, keep,
                                 u_next, out, mask, mean, invstd, scale, shift,
                                 momentum, bn_eps, eps);
}

void kcla_branch_train_backward(
    const at::Tensor grad_out, const OptTensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor mean, const at::Tensor invstd,
    at::Tensor grad_x, const OptTensor grad_u, const OptTensor u_prev,
    at::Tensor grad_w, at::Tensor grad_z, at::Tensor grad_gate,
    at::Tensor grad_weight, at::Tensor grad_bn_weight,
    at::Tensor grad_bn_bias, bool batch_stats, double eps) {
  FeatureArgChecker ck("kcla_branch_train_backward", out, w, false, "out");
  const at::Tensor grad_u_next_t = optional_tensor(grad_u_next);
  const at::Tensor grad_u_t = optional_tensor(grad_u);
  const at::Tensor u_prev_t = optional_tensor(u_prev);
  check_backward_args(ck, grad_out, grad_u_next_t, u_next, z, gate, weight,
                      scale, shift, keep, mask, mean, grad_x, grad_u_t,
                      u_prev_t);
  ck.channels(invstd, "invstd");
  ck.heads(grad_w, "grad_w");
  ck.heads(grad_z, "grad_z");
  ck.heads(grad_gate, "grad_gate");
  ck.kernel(grad_weight, "grad_weight");
  ck.channels(grad_bn_weight, "grad_bn_weight");
  ck.channels(grad_bn_bias, "grad_bn_bias");
  kcla_branch_train_backward_impl(
      grad_out, grad_u_next_t, out, u_next, w, z, gate, weight, scale, shift,
      keep, mask, mean, invstd, grad_x, grad_u_t, u_prev_t, grad_w, grad_z,
      grad_gate, grad_weight, grad_bn_weight, grad_bn_bias, batch_stats,
      eps);
}

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
    double max_log_weight, double bn_eps, double tail_eps) {
  const char* op = "kcla_layer_inference";
  FeatureArgChecker ck(op, s, w, false, "s");
  const at::Tensor residual_t = optional_tensor(residual);
  const at::Tensor tail[] = {
      optional_tensor(tail_weight), optional_tensor(tail_bias),
      optional_tensor(tail_mean), optional_tensor(tail_var)};
  const at::Tensor u_t = optional_tensor(u), z_t = optional_tensor(z);
  ck.map(residual_t, "residual");
  const char* tail_names[] = {"tail_weight", "tail_bias", "tail_mean",
                              "tail_var"};
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(tail[i].defined() == tail[0].defined(), op,
                ": `tail_weight`, `tail_bias`, `tail_mean` and `tail_var` "
                "must be given together (the block's last BN) or all be "
                "None");
    if (tail[i].defined()) ck.channels(tail[i], tail_names[i]);
  }
  ck.map(u_t, "u");
  if (z_t.defined()) ck.heads(z_t, "z");
  TORCH_CHECK(u_t.defined() == z_t.defined(), op,
              ": `u` and `z` must be given together (a state) or both be "
              "None (the first layer)");
  check_head_params(op, s, "s", q_kernel, k_kernel, norm_d, gate_weight,
                    w.size(1));
  ck.kernel(weight, "weight");
  ck.channels(bn_weight, "bn_weight");
  ck.channels(bn_bias, "bn_bias");
  ck.channels(bn_mean, "bn_mean");
  ck.channels(bn_var, "bn_var");
  ck.map(u_next, "u_next");
  ck.heads(z_next, "z_next");
  ck.heads(gate, "gate");
  TORCH_CHECK(bn_eps > 0 && (!tail[0].defined() || tail_eps > 0), op,
              ": BN eps must be positive, got bn_eps=", bn_eps,
              ", tail_eps=", tail_eps);
  kcla_layer_inference_impl(
      s, {residual_t, tail[0], tail[1], tail[2], tail[3], u_t, z_t,
          q_kernel, k_kernel, norm_d, gate_weight, weight, bn_weight,
          bn_bias, bn_mean, bn_var, u_next, w, z_next, gate, eps, key_eps,
          max_log_weight, bn_eps, tail_eps});
}

void kcla_heads_forward(const at::Tensor pooled, const OptTensor z,
                        const at::Tensor q_kernel, const at::Tensor k_kernel,
                        const at::Tensor norm_d, const at::Tensor gate_weight,
                        at::Tensor w, at::Tensor z_next, at::Tensor gate,
                        double key_eps, double max_log_weight) {
  const char* op = "kcla_heads_forward";
  HeadArgChecker ck(op, pooled, w);
  const at::Tensor z_t = optional_tensor(z);
  if (z_t.defined()) ck.heads(z_t, "z");
  check_head_params(op, pooled, "pooled", q_kernel, k_kernel, norm_d,
                    gate_weight, w.size(1));
  ck.heads(z_next, "z_next");
  ck.heads(gate, "gate");
  kcla_heads_forward_impl(pooled, z_t, q_kernel, k_kernel, norm_d,
                          gate_weight, w, z_next, gate, key_eps,
                          max_log_weight);
}

void kcla_heads_backward(
    const at::Tensor pooled, const at::Tensor q_kernel,
    const at::Tensor k_kernel, const at::Tensor norm_d,
    const at::Tensor gate_weight, const at::Tensor w, const at::Tensor gate,
    const at::Tensor grad_w, const at::Tensor grad_gate,
    at::Tensor grad_pooled, at::Tensor grad_q_kernel,
    at::Tensor grad_k_kernel, at::Tensor grad_gate_weight, double key_eps,
    double max_log_weight) {
  const char* op = "kcla_heads_backward";
  HeadArgChecker ck(op, pooled, w);
  check_head_params(op, pooled, "pooled", q_kernel, k_kernel, norm_d,
                    gate_weight, w.size(1));
  ck.heads(gate, "gate");
  ck.heads(grad_w, "grad_w");
  ck.heads(grad_gate, "grad_gate");
  ck.like(grad_pooled, pooled, "grad_pooled", "pooled");
  ck.like(grad_q_kernel, q_kernel, "grad_q_kernel", "q_kernel");
  ck.like(grad_k_kernel, k_kernel, "grad_k_kernel", "k_kernel");
  ck.like(grad_gate_weight, gate_weight, "grad_gate_weight", "gate_weight");
  kcla_heads_backward_impl(pooled, q_kernel, k_kernel, norm_d, gate_weight,
                           w, gate, grad_w, grad_gate, grad_pooled,
                           grad_q_kernel, grad_k_kernel, grad_gate_weight,
                           key_eps, max_log_weight);
}

void kcla_adapter_inference(
    const at::Tensor u, const at::Tensor z, const at::Tensor weight,
    int64_t stride, const at::Tensor bn_weight, const at::Tensor bn_bias,
    const at::Tensor bn_mean, const at::Tensor bn_var,
    const at::Tensor k_kernel, const at::Tensor norm_d, at::Tensor u_out,
    at::Tensor z_out, double bn_eps, double max_log_weight) {
  const char* op = "kcla_adapter_inference";
  FeatureArgChecker ck_in(op, u, z, false, "u", "z");
  TORCH_CHECK(stride >= 1, op, ": `stride` must be >= 1, got ", stride);
  const int64_t B = u.size(0), Ci = u.size(1);
  const int64_t h = (u.size(2) + stride - 1) / stride;
  const int64_t w = (u.size(3) + stride - 1) / stride;
  check_operand(u_out, op, "u_out", u, "u");
  TORCH_CHECK(u_out.dim() == 4 && u_out.size(0) == B && u_out.size(2) == h &&
                  u_out.size(3) == w,
              op, ": argument `u_out` must be (B, C, h, w) = (", B, ", C, ",
              h, ", ", w, ") (u at stride ", stride, "), got ",
              u_out.sizes());
  FeatureArgChecker ck(op, u_out, z_out, false, "u_out", "z_out");
  const int64_t C = u_out.size(1), G = z_out.size(1);
  TORCH_CHECK(Ci % G == 0, op, ": the ", G, " heads of `z_out` must divide "
              "the incoming channels C' = ", Ci);
  check_operand(weight, op, "weight", u, "u");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C &&
                  weight.size(1) == Ci / G,
              op, ": argument `weight` must be (C, C' / G) = (", C, ", ",
              Ci / G, "), got ", weight.sizes());
  ck.channels(bn_weight, "bn_weight");
  ck.channels(bn_bias, "bn_bias");
  ck.channels(bn_mean, "bn_mean");
  ck.channels(bn_var, "bn_var");
  check_operand(k_kernel, op, "k_kernel", u, "u");
  check_operand(norm_d, op, "norm_d", u, "u");
  TORCH_CHECK(k_kernel.numel() % 2 == 1, op,
              ": argument `k_kernel` must hold an odd number of elements, "
              "got shape ", k_kernel.sizes());
  TORCH_CHECK(norm_d.numel() == G, op, ": argument `norm_d` must hold G = ",
              G, " elements, got shape ", norm_d.sizes());
  TORCH_CHECK(bn_eps > 0, op, ": BN eps must be positive, got ", bn_eps);
  kcla_adapter_inference_impl(u, z, weight, stride, bn_weight, bn_bias,
                              bn_mean, bn_var, k_kernel, norm_d, u_out, z_out,
                              bn_eps, max_log_weight);
}
