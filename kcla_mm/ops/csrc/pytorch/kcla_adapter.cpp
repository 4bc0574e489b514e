// The cross-stage adapter in training as a C++ autograd op: the maps'
// batched matmuls in ATen, the per-head scalars (common/
// kcla_adapter_impl.hpp) in one device kernel each way, behind operand
// checks that name the bad argument.
#include "kcla_adapter_impl.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include "fused_backward.hpp"
#include "pytorch_cpp_helper.hpp"
#include "pytorch_device_registry.hpp"

void kcla_adapter_heads_forward_impl(const at::Tensor um,
                                     const AdapterHeads& a,
                                     const AdapterHeadsOut& out) {
  DISPATCH_DEVICE_IMPL(kcla_adapter_heads_forward_impl, um, a, out);
}

void kcla_adapter_heads_backward_impl(const at::Tensor um,
                                      const AdapterHeads& a,
                                      const AdapterHeadsOut& saved,
                                      const AdapterHeadsGrads& g) {
  DISPATCH_DEVICE_IMPL(kcla_adapter_heads_backward_impl, um, a, saved, g);
}

namespace {

// Raise unless `t` is contiguous, on um's device with its dtype, of `size`.
void check_shaped(const at::Tensor& t, const char* name,
                  const at::Tensor& um, at::IntArrayRef size,
                  const char* op) {
  check_operand(t, op, name, um, "um");
  TORCH_CHECK(t.sizes() == size, op, ": argument `", name, "` must be ",
              size, ", got ", t.sizes());
}

void check_operands(const AdapterHeads& a, const char* op, bool forward) {
  const at::Tensor& um = a.um;
  check_contiguous(um, op, "um");
  TORCH_CHECK(um.scalar_type() == at::kFloat ||
                  um.scalar_type() == at::kDouble,
              op, ": argument `um` must be float32 or float64, got ",
              um.scalar_type());
  TORCH_CHECK(um.dim() == 3 && um.numel() > 0, op,
              ": argument `um` must be (B, G, ci), got ", um.sizes());
  const int64_t B = um.size(0), G = um.size(1), ci = um.size(2);
  const int64_t co = a.weight.defined() ? a.weight.size(1) : ci;
  if (a.weight.defined()) {
    check_operand(a.weight, op, "weight", um, "um");
    TORCH_CHECK(a.weight.dim() == 3 && a.weight.size(0) == G &&
                    a.weight.size(2) == ci,
                op, ": argument `weight` must be (G, co, ci) with G = ", G,
                ", ci = ", ci, ", got ", a.weight.sizes());
  }
  check_operand(a.z_in, op, "z_in", um, "um");
  TORCH_CHECK(a.z_in.dim() == 2 && a.z_in.size(0) == B &&
                  a.z_in.size(1) > 0 && (G * ci) % a.z_in.size(1) == 0,
              op, ": argument `z_in` must be (B, Gi) with B = ", B,
              " and Gi dividing C' = ", G * ci, ", got ", a.z_in.sizes());
  if (a.batch_stats) {
    check_shaped(a.cov, "cov", um, {B, G, ci, ci}, op);
    TORCH_CHECK(B * a.hw > 1, op, ": batch statistics need more than 1 "
                "value per channel, got B = ", B, ", hw = ", a.hw);
  } else {
    TORCH_CHECK(!a.cov.defined(), op, ": argument `cov` is for batch "
                "statistics only");
    TORCH_CHECK(!forward || a.running_mean.defined(), op,
                ": running statistics "
                "(running_mean, running_var) are needed without batch "
                "statistics");
  }
  TORCH_CHECK(a.hw >= 1, op, ": `hw` must be >= 1, got ", a.hw);
  const int64_t C = G * co;
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{a.bn_weight, "bn_weight"},
        {a.bn_bias, "bn_bias"}})
    check_shaped(t, name, um, {C}, op);
  TORCH_CHECK(a.running_mean.defined() == a.running_var.defined(), op,
              ": give both running_mean and running_var, or neither");
  if (a.running_mean.defined()) {
    check_shaped(a.running_mean, "running_mean", um, {C}, op);
    check_shaped(a.running_var, "running_var", um, {C}, op);
  }
  check_operand(a.k_kernel, op, "k_kernel", um, "um");
  TORCH_CHECK(a.k_kernel.numel() % 2 == 1, op,
              ": argument `k_kernel` must hold an odd number of elements, "
              "got shape ", a.k_kernel.sizes());
  check_operand(a.norm_d, op, "norm_d", um, "um");
  TORCH_CHECK(a.norm_d.numel() == G, op, ": argument `norm_d` must hold G = ",
              G, " elements, got shape ", a.norm_d.sizes());
  TORCH_CHECK(a.bn_eps > 0, op, ": BN eps must be positive, got ", a.bn_eps);
}

}  // namespace

static std::vector<at::Tensor> kcla_adapter_heads_forward(
    const AdapterHeads& a) {
  check_operands(a, "kcla_adapter_heads_forward", true);
  const int64_t B = a.um.size(0), G = a.um.size(1), ci = a.um.size(2);
  const int64_t co = a.weight.defined() ? a.weight.size(1) : ci;
  const auto opt = a.um.options();
  AdapterHeadsOut out{at::empty({B, G, co, ci}, opt),
                      at::empty({B, G, co}, opt), at::empty({B, G}, opt),
                      at::empty({3, B, G, co}, opt),
                      at::empty({2, G, co}, opt)};
  kcla_adapter_heads_forward_impl(a.um, a, out);
  return {out.mat, out.bias, out.z_out, out.aux, out.bn_stats};
}

static std::vector<at::Tensor> kcla_adapter_heads_backward(
    const AdapterHeads& a, const AdapterHeadsOut& saved,
    const at::Tensor& grad_mat, const at::Tensor& grad_bias,
    const at::Tensor& grad_z) {
  const char* op = "kcla_adapter_heads_backward";
  check_operands(a, op, false);
  const int64_t B = a.um.size(0), G = a.um.size(1), ci = a.um.size(2);
  const int64_t co = a.weight.defined() ? a.weight.size(1) : ci;
  check_shaped(saved.z_out, "z_out", a.um, {B, G}, op);
  check_shaped(saved.aux, "aux", a.um, {3, B, G, co}, op);
  check_shaped(saved.bn_stats, "bn_stats", a.um, {2, G, co}, op);
  check_shaped(grad_mat, "grad_mat", a.um, {B, G, co, ci}, op);
  check_shaped(grad_bias, "grad_bias", a.um, {B, G, co}, op);
  if (grad_z.defined()) check_shaped(grad_z, "grad_z", a.um, {B, G}, op);
  const auto opt = a.um.options();
  AdapterHeadsGrads g{grad_mat,
                      grad_bias,
                      grad_z,
                      at::empty({B, G, ci}, opt),
                      a.batch_stats ? at::empty({B, G, ci, ci}, opt)
                                    : at::Tensor(),
                      at::empty_like(a.z_in),
                      a.weight.defined() ? at::empty_like(a.weight)
                                         : at::Tensor(),
                      at::empty_like(a.bn_weight),
                      at::empty_like(a.bn_bias),
                      at::empty_like(a.k_kernel)};
  kcla_adapter_heads_backward_impl(a.um, a, saved, g);
  return {g.r, g.s, g.grad_z_in, g.grad_weight, g.grad_bn_weight,
          g.grad_bn_bias, g.grad_k_kernel};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The saved tensors of KCLAAdapterFunction, in save_for_backward's order.
enum AdapterSaved {
  kU, kUm, kCov, kZIn, kWeight, kBnWeight, kBnBias, kKKernel, kNormD, kMat,
  kZOut, kAux, kBnStats
};

struct KCLAAdapterFunction
    : torch::autograd::Function<KCLAAdapterFunction> {
  // U' = mat @ Us + bias over (sample, group), Us the strided state
  // (centred with batch statistics) as (B * G, ci, h * w)
  static variable_list forward(
      AutogradContext* ctx, at::Tensor u, at::Tensor z,
      c10::optional<at::Tensor> weight, at::Tensor bn_weight,
      at::Tensor bn_bias, c10::optional<at::Tensor> running_mean,
      c10::optional<at::Tensor> running_var, at::Tensor k_kernel,
      at::Tensor norm_d, int64_t stride, bool batch_stats, double momentum,
      double bn_eps, double max_log_weight) {
    const char* op = "kcla_adapter_autograd";
    TORCH_CHECK(u.dim() == 4, op, ": argument `u` must be (B, C', H', W'), "
                "got ", u.sizes());
    TORCH_CHECK(stride >= 1, op, ": `stride` must be >= 1, got ", stride);
    const int64_t G = norm_d.numel();
    TORCH_CHECK(G > 0 && u.size(1) % G == 0, op, ": the ", G,
                " heads of `norm_d` must divide C' = ", u.size(1));
    at::Tensor us = u.slice(2, 0, c10::nullopt, stride)
                        .slice(3, 0, c10::nullopt, stride);
    const int64_t B = u.size(0), ci = u.size(1) / G;
    const int64_t h = us.size(2), w = us.size(3), hw = h * w;
    at::Tensor um = us.mean({2, 3});  // (B, C')
    at::Tensor u3, cov;
    if (batch_stats) {  // centred, contiguous at any stride
      u3 = (us - um.view({B, G * ci, 1, 1})).view({B * G, ci, hw});
      cov = at::bmm(u3, u3.transpose(1, 2));
    } else {
      u3 = us.reshape({B * G, ci, hw});
    }
    TORCH_CHECK(!weight.has_value() ||
                    (weight->dim() == 4 && weight->size(0) % G == 0 &&
                     weight->size(1) == ci && weight->size(2) == 1 &&
                     weight->size(3) == 1),
                op, ": argument `weight` must be the grouped 1x1 conv's "
                "(C, C' / G, 1, 1) with C' / G = ", ci, ", G = ", G,
                " dividing C, got ",
                weight.has_value() ? weight->sizes() : at::IntArrayRef());
    at::Tensor w3 = weight.has_value()
                        ? weight->reshape({G, weight->size(0) / G, ci})
                        : at::Tensor();
    const AdapterHeads a{
        um.view({B, G, ci}),
        batch_stats ? cov.view({B, G, ci, ci}) : at::Tensor(),
        z, w3, bn_weight, bn_bias, running_mean.value_or(at::Tensor()),
        running_var.value_or(at::Tensor()), k_kernel, norm_d, hw,
        batch_stats, momentum, bn_eps, max_log_weight};
    auto out = kcla_adapter_heads_forward(a);
    const at::Tensor &mat = out[0], &bias = out[1];
    const int64_t co = mat.size(2);
    at::Tensor u_out = at::baddbmm(bias.view({B * G, co, 1}),
                                   mat.view({B * G, co, ci}), u3);
    ctx->save_for_backward({u3, a.um, a.cov, z, w3, bn_weight, bn_bias,
                            k_kernel, norm_d, mat, out[2], out[3], out[4]});
    ctx->saved_data["size"] = u.sizes().vec();
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["batch_stats"] = batch_stats;
    ctx->saved_data["bn_eps"] = bn_eps;
    ctx->saved_data["max_log"] = max_log_weight;
    ctx->saved_data["has_weight"] = weight.has_value();
    return {u_out.view({B, G * co, h, w}), out[2]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return first_order_backward(grads, [&]() -> variable_list {
      const variable_list s = ctx->get_saved_variables();
      const at::Tensor& u3 = s[kU];
      const int64_t BG = u3.size(0), ci = u3.size(1), hw = u3.size(2);
      const int64_t B = s[kZIn].size(0), G = BG / B, co = s[kMat].size(2);
      const bool batch_stats = ctx->saved_data["batch_stats"].toBool();
      at::Tensor go = grads[0].defined()
                          ? grads[0].reshape({BG, co, hw})
                          : at::zeros({BG, co, hw}, u3.options());
      at::Tensor grad_mat = at::bmm(go, u3.transpose(1, 2));
      at::Tensor grad_bias = go.sum(-1);
      const AdapterHeads a{
          s[kUm], s[kCov], s[kZIn], s[kWeight], s[kBnWeight], s[kBnBias],
          at::Tensor(), at::Tensor(), s[kKKernel], s[kNormD], hw,
          batch_stats, -1.0, ctx->saved_data["bn_eps"].toDouble(),
          ctx->saved_data["max_log"].toDouble()};
      auto g = kcla_adapter_heads_backward(
          a, {s[kMat], at::Tensor(), s[kZOut], s[kAux], s[kBnStats]},
          grad_mat.view({B, G, co, ci}), grad_bias.view({B, G, co}),
          grads[1].defined() ? grads[1].contiguous() : at::Tensor());
      // grad Us = mat^T @ grad U' + s @ Us + r
      at::Tensor gu = at::baddbmm(g[0].view({BG, ci, 1}),
                                  s[kMat].view({BG, co, ci}).transpose(1, 2),
                                  go);
      if (batch_stats) gu.baddbmm_(g[1].view({BG, ci, ci}), u3);
      const auto size = ctx->saved_data["size"].toIntVector();
      const int64_t stride = ctx->saved_data["stride"].toInt();
      const int64_t h = (size[2] + stride - 1) / stride;
      gu = gu.view({size[0], size[1], h, hw / h});
      at::Tensor grad_u = gu;
      if (stride > 1) {
        grad_u = at::zeros(size, gu.options());
        grad_u.slice(2, 0, c10::nullopt, stride)
            .slice(3, 0, c10::nullopt, stride)
            .copy_(gu);
      }
      at::Tensor grad_weight;
      if (ctx->saved_data["has_weight"].toBool())
        grad_weight = g[3].view({G * co, ci, 1, 1});
      return {grad_u, g[2], grad_weight, g[4], g[5], {}, {}, g[6],
              {}, {}, {}, {}, {}, {}};
    });
  }
};

}  // namespace

std::vector<at::Tensor> kcla_adapter_autograd(
    at::Tensor u, at::Tensor z, c10::optional<at::Tensor> weight,
    at::Tensor bn_weight, at::Tensor bn_bias,
    c10::optional<at::Tensor> running_mean,
    c10::optional<at::Tensor> running_var, at::Tensor k_kernel,
    at::Tensor norm_d, int64_t stride, bool batch_stats, double momentum,
    double bn_eps, double max_log_weight) {
  return KCLAAdapterFunction::apply(u, z, weight, bn_weight, bn_bias,
                                    running_mean, running_var, k_kernel,
                                    norm_d, stride, batch_stats, momentum,
                                    bn_eps, max_log_weight);
}
