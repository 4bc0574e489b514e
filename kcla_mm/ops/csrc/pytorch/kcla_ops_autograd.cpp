// The autograd ops of the KCLA heads and the state update as C++
// torch::autograd::Functions (first order, unbatched: fused_backward.hpp);
// kcla_mm/ops/kcla_heads.py and kcla_mm/ops/kcla_state.py document the
// maths.
#include "kcla_ops_autograd.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include "fused_backward.hpp"
#include "kcla_branch_impl.hpp"
#include "kcla_state_impl.hpp"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct KCLAHeadsFunction : torch::autograd::Function<KCLAHeadsFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor pooled,
                               c10::optional<at::Tensor> z,
                               at::Tensor q_kernel, at::Tensor k_kernel,
                               at::Tensor norm_d, at::Tensor gate_weight,
                               double key_eps, double max_log_weight) {
    const auto options = pooled.options();
    const std::vector<int64_t> size{pooled.size(0), norm_d.size(0)};
    at::Tensor w = at::empty(size, options);
    at::Tensor z_next = at::empty(size, options);
    at::Tensor gate = at::empty(size, options);
    kcla_heads_forward(pooled, z, q_kernel, k_kernel, norm_d, gate_weight, w,
                       z_next, gate, key_eps, max_log_weight);
    ctx->save_for_backward(
        {pooled, q_kernel, k_kernel, norm_d, gate_weight, w, gate});
    ctx->saved_data["key_eps"] = key_eps;
    ctx->saved_data["max_log_weight"] = max_log_weight;
    ctx->saved_data["has_z"] = z.has_value();
    ctx->set_materialize_grads(false);
    return {w, z_next, gate};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return first_order_backward(grads, [&]() -> variable_list {
      const variable_list saved = ctx->get_saved_variables();
      const at::Tensor &pooled = saved[0], &q_kernel = saved[1],
                       &k_kernel = saved[2], &norm_d = saved[3],
                       &gate_weight = saved[4], &w = saved[5],
                       &gate = saved[6];
      const at::Tensor &grad_w = grads[0], &grad_z_next = grads[1];
      // z' = z + w: w's total gradient includes z''s
      at::Tensor total = grad_w.defined() && grad_z_next.defined()
                             ? grad_w + grad_z_next
                         : grad_w.defined()      ? grad_w
                         : grad_z_next.defined() ? grad_z_next
                                                 : at::zeros_like(w);
      const at::Tensor grad_gate = grads[2].defined()
                                       ? grads[2].contiguous()
                                       : at::zeros_like(gate);
      at::Tensor grad_pooled = at::empty_like(pooled);
      at::Tensor grad_q = at::empty_like(q_kernel);
      at::Tensor grad_k = at::empty_like(k_kernel);
      at::Tensor grad_gate_weight = at::empty_like(gate_weight);
      kcla_heads_backward(pooled, q_kernel, k_kernel, norm_d, gate_weight, w,
                          gate, total.contiguous(), grad_gate, grad_pooled,
                          grad_q, grad_k, grad_gate_weight,
                          ctx->saved_data["key_eps"].toDouble(),
                          ctx->saved_data["max_log_weight"].toDouble());
      const bool has_z = ctx->saved_data["has_z"].toBool();
      return {grad_pooled, has_z ? grad_z_next : at::Tensor(),
              grad_q,      grad_k,
              {},          grad_gate_weight,
              {},          {}};
    });
  }
};

struct KCLAStateFunction : torch::autograd::Function<KCLAStateFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x,
                               c10::optional<at::Tensor> u, at::Tensor w,
                               at::Tensor z, double eps) {
    at::Tensor u_next = at::empty_like(x);
    at::Tensor agg = at::empty_like(x);
    kcla_state_forward(x, u, w, z, u_next, agg, eps);
    ctx->save_for_backward({x, w, z, agg});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["has_u"] = u.has_value();
    ctx->set_materialize_grads(false);
    return {u_next, agg};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return first_order_backward(grads, [&]() -> variable_list {
      const variable_list saved = ctx->get_saved_variables();
      const at::Tensor &x = saved[0], &w = saved[1], &z = saved[2],
                       &agg = saved[3];
      const at::Tensor grad_u_next = grads[0].defined()
                                         ? grads[0].contiguous()
                                         : at::zeros_like(x);
      const at::Tensor grad_agg = grads[1].defined() ? grads[1].contiguous()
                                                     : at::zeros_like(x);
      at::Tensor grad_x = at::empty_like(x);
      c10::optional<at::Tensor> grad_u;
      if (ctx->saved_data["has_u"].toBool()) grad_u = at::empty_like(x);
      at::Tensor grad_w = at::empty_like(w);
      at::Tensor grad_z = at::empty_like(z);
      kcla_state_backward(grad_u_next, grad_agg, x, w, z, agg, grad_x,
                          grad_u, grad_w, grad_z,
                          ctx->saved_data["eps"].toDouble());
      return {grad_x, grad_u.value_or(at::Tensor()), grad_w, grad_z, {}};
    });
  }
};

}  // namespace

std::vector<at::Tensor> kcla_heads_autograd(
    at::Tensor pooled, c10::optional<at::Tensor> z, at::Tensor q_kernel,
    at::Tensor k_kernel, at::Tensor norm_d, at::Tensor gate_weight,
    double key_eps, double max_log_weight) {
  return KCLAHeadsFunction::apply(pooled, z, q_kernel, k_kernel, norm_d,
                                  gate_weight, key_eps, max_log_weight);
}

std::vector<at::Tensor> kcla_state_autograd(at::Tensor x,
                                            c10::optional<at::Tensor> u,
                                            at::Tensor w, at::Tensor z,
                                            double eps) {
  return KCLAStateFunction::apply(x, u, w, z, eps);
}
