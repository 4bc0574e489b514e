// The autograd ops of relu_pool and the fused KCLA branch as C++
// torch::autograd::Functions: kcla_mm/ops/kcla_branch.py documents the
// maths, the tapes and the handoffs (Python objects, whose methods these
// ops call). In C++ a layer's two ops skip Python's Function machinery,
// about a tenth of a 7x7 layer's training step on a 2-core CPU.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/extension.h>

#include <utility>
#include <vector>

#include "fused_backward.hpp"
#include "kcla_branch_impl.hpp"
#include "kcla_state_impl.hpp"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A Python object (a StateTape or GradHandoff) kept for backward, released
// under the GIL (backward runs without it).
struct PyObjectRef : torch::CustomClassHolder {
  explicit PyObjectRef(py::object o) : obj(std::move(o)) {}
  ~PyObjectRef() override {
    if (!Py_IsInitialized()) {
      obj.release();  // the interpreter is gone: nothing to decrement
      return;
    }
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
  py::object obj;
};

void keep_object(AutogradContext* ctx, const char* key,
                 const py::object& obj) {
  if (!obj.is_none())
    ctx->saved_data[key] =
        at::IValue::make_capsule(c10::make_intrusive<PyObjectRef>(obj));
}

// The object keep_object stored under `key` (not a new reference: no GIL
// needed), or nullptr for None.
const py::object* kept_object(AutogradContext* ctx, const char* key) {
  auto it = ctx->saved_data.find(key);
  if (it == ctx->saved_data.end()) return nullptr;
  return &static_cast<PyObjectRef*>(it->second.toCapsule().get())->obj;
}

// An uninitialised (B, C, ceil(H * W / 8)) uint8 bit mask for `x`.
at::Tensor bit_mask(const at::Tensor& x) {
  return at::empty({x.size(0), x.size(1), (x.size(2) * x.size(3) + 7) / 8},
                   x.options().dtype(at::kByte));
}

py::object py_tensor(const at::Tensor& t) {
  return t.defined() ? py::cast(t) : py::none();
}

// handoff.owns(grad) (a GradHandoff): whether `grad` is the tensor handed
// through it; the caller holds the GIL.
bool owns(const py::object& handoff, const at::Tensor& grad) {
  return handoff.attr("owns")(py_tensor(grad)).cast<bool>();
}

struct ReLUPoolFunction : torch::autograd::Function<ReLUPoolFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor s,
                               c10::optional<at::Tensor> residual,
                               py::object handoff, bool grad_in_place) {
    at::Tensor mask = bit_mask(s);
    at::Tensor pooled = at::empty({s.size(0), s.size(1)}, s.options());
    kcla_relu_pool_forward(s, residual, mask, pooled);
    ctx->mark_dirty({s});
    ctx->save_for_backward({mask});
    ctx->saved_data["size"] = s.sizes().vec();
    ctx->saved_data["has_residual"] = residual.has_value();
    ctx->saved_data["grad_in_place"] = grad_in_place;
    keep_object(ctx, "handoff", handoff);
    ctx->set_materialize_grads(false);
    return {s, pooled};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return first_order_backward(grads, [&]() -> variable_list {
      const at::Tensor mask = ctx->get_saved_variables()[0];
      at::Tensor grad_x = grads[0], grad_pooled = grads[1];
      bool owned = false;
      if (const py::object* handoff = kept_object(ctx, "handoff")) {
        py::gil_scoped_acquire gil;
        owned = owns(*handoff, grad_x);
      }
      if (!grad_x.defined() && !grad_pooled.defined()) return {{}, {}, {}, {}};
      const at::Tensor ref = grad_x.defined() ? grad_x : grad_pooled;
      const auto size = ctx->saved_data["size"].toIntVector();
      grad_x = grad_x.defined() ? grad_x.contiguous()
                                : at::zeros(size, ref.options());
      grad_pooled = grad_pooled.defined()
                        ? grad_pooled.contiguous()
                        : at::zeros({size[0], size[1]}, ref.options());
      at::Tensor grad_s =
          owned && ctx->saved_data["grad_in_place"].toBool()
              ? grad_x
              : at::empty_like(grad_x);
      kcla_relu_pool_backward(grad_x, grad_pooled, mask, grad_s);
      return {grad_s,
              ctx->saved_data["has_residual"].toBool() ? grad_s
                                                       : at::Tensor(),
              {}, {}};
    });
  }
};

// BN(o) = scale * o + shift from a mean and a (biased) variance: (invstd,
// scale, shift), each (C,) in `dtype`.
std::vector<at::Tensor> fold_bn(const at::Tensor& bn_weight,
                                const at::Tensor& bn_bias,
                                const at::Tensor& mean, const at::Tensor& var,
                                double bn_eps, at::ScalarType dtype) {
  at::Tensor invstd = at::rsqrt(var.to(dtype) + bn_eps);
  at::Tensor scale = bn_weight.to(dtype) * invstd;
  at::Tensor shift = bn_bias.to(dtype) - mean.to(dtype) * scale;
  return {invstd, scale.contiguous(), shift.contiguous()};
}

// Channel mean and biased variance (float64) from per-plane (mean, M2),
// (B, C, 2) (Chan et al.'s parallel combination).
std::pair<at::Tensor, at::Tensor> combine_plane_stats(at::Tensor stats,
                                                      int64_t hw) {
  stats = stats.to(at::kDouble);
  at::Tensor plane_mean = stats.select(-1, 0), m2 = stats.select(-1, 1);
  at::Tensor mean = plane_mean.mean(0);
  m2 = m2.sum(0) + hw * (plane_mean - mean).square().sum(0);
  return {mean, m2 / (stats.size(0) * hw)};
}

// nn.BatchNorm2d's running-statistics update from batch `mean` and biased
// `var` over `n` values per channel.
void update_running_stats(at::Tensor running_mean, at::Tensor running_var,
                          const at::Tensor& mean, const at::Tensor& var,
                          int64_t n, double momentum) {
  running_mean.mul_(1 - momentum)
      .add_(momentum * mean.to(running_mean.scalar_type()));
  running_var.mul_(1 - momentum)
      .add_(momentum * var.to(running_var.scalar_type()) * n /
            std::max<int64_t>(n - 1, 1));
}

// Forward of the branch with one kernel per pass: BN's batch statistics
// on devices without the 'layer' kernels, and eval-mode BN (folded, one
// pass) on every device; returns the saved (mean, invstd, scale, shift).
std::vector<at::Tensor> branch_forward_per_kernel(
    const at::Tensor& x, const c10::optional<at::Tensor>& u,
    const at::Tensor& w, const at::Tensor& z, const at::Tensor& gate,
    const at::Tensor& weight, const at::Tensor& bn_weight,
    const at::Tensor& bn_bias, const at::Tensor& running_mean,
    const at::Tensor& running_var, const at::Tensor& keep,
    c10::optional<double> momentum, bool use_batch_stats, double bn_eps,
    double eps, at::Tensor u_next, at::Tensor out, at::Tensor mask) {
  const auto b = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3);
  if (!use_batch_stats) {
    auto folded =
        fold_bn(bn_weight, bn_bias, running_mean, running_var, bn_eps,
                x.scalar_type());
    kcla_branch_forward(x, u, w, z, gate, weight, folded[1], folded[2], keep,
                        u_next, out, mask, eps);
    return {running_mean.to(x.scalar_type()).contiguous(), folded[0],
            folded[1], folded[2]};
  }
  at::Tensor stats = at::empty({b, c, 2}, x.options());
  kcla_branch_stats(x, u, w, z, gate, weight, u_next, stats, eps);
  auto [mean, var] = combine_plane_stats(stats, hw);
  if (momentum.has_value())
    update_running_stats(running_mean, running_var, mean, var, b * hw,
                         *momentum);
  auto folded = fold_bn(bn_weight, bn_bias, mean, var, bn_eps,
                        x.scalar_type());
  kcla_branch_apply(x, u_next, z, gate, weight, folded[1], folded[2], keep,
                    out, mask, eps);
  return {mean.to(x.scalar_type()).contiguous(), folded[0], folded[1],
          folded[2]};
}

// The saved tensors of KCLABranchFunction, in save_for_backward's order.
enum Saved {
  kOut, kUNext, kW, kZ, kGate, kWeight, kKeep, kMask, kMean, kInvstd,
  kScale, kShift
};

struct BranchGrads {
  at::Tensor w, z, gate, weight, bn_weight, bn_bias;
};

// Backward of the branch with one kernel per pass and the reductions in
// torch (devices without the 'layer' kernels).
BranchGrads branch_backward_per_kernel(
    const variable_list& saved, const at::Tensor& grad_out,
    const c10::optional<at::Tensor>& grad_u_next, const at::Tensor& u_next,
    const at::Tensor& grad_x, const c10::optional<at::Tensor>& grad_u,
    const c10::optional<at::Tensor>& u_prev, bool use_batch_stats,
    double eps) {
  const at::Tensor &out = saved[kOut], &w = saved[kW], &z = saved[kZ],
                   &gate = saved[kGate], &weight = saved[kWeight],
                   &keep = saved[kKeep], &mask = saved[kMask],
                   &mean = saved[kMean], &invstd = saved[kInvstd],
                   &scale = saved[kScale], &shift = saved[kShift];
  const auto b = out.size(0), c = out.size(1);
  const auto n = b * out.size(2) * out.size(3);
  at::Tensor sum_grad, sum_grad_xhat, alpha, beta;
  if (use_batch_stats) {  // the batch statistics depend on o
    at::Tensor bn_sums = at::empty({b, c, 2}, out.options());
    kcla_branch_bn_sums(grad_out, u_next, z, gate, weight, keep, mask, mean,
                        bn_sums, eps);
    at::Tensor sums = bn_sums.sum(0);
    sum_grad = sums.select(-1, 0);
    sum_grad_xhat = invstd * sums.select(-1, 1);
    alpha = (-scale * sum_grad / n).contiguous();
    beta = (-scale * invstd * sum_grad_xhat / n).contiguous();
  } else {
    alpha = beta = at::zeros_like(scale);
  }
  at::Tensor plane_bn_sums = at::empty({b, c, 2}, out.options());
  at::Tensor head_sums = at::empty({b, c, 3}, out.options());
  at::Tensor weight_sums = at::empty({b, c, 9}, out.options());
  kcla_branch_backward(grad_out, grad_u_next, out, u_next, w, z, gate,
                       weight, scale, shift, keep, mask, alpha, beta, mean,
                       grad_x, grad_u, u_prev, plane_bn_sums, head_sums,
                       weight_sums, eps);
  if (!use_batch_stats) {
    at::Tensor sums = plane_bn_sums.sum(0);
    sum_grad = sums.select(-1, 0);
    sum_grad_xhat = invstd * sums.select(-1, 1);
  }
  const auto g = w.size(1);
  at::Tensor heads = head_sums.view({b, g, c / g, 3}).sum(2);
  return {heads.select(-1, 0), heads.select(-1, 1), heads.select(-1, 2),
          weight_sums.sum(0).view_as(weight), sum_grad_xhat, sum_grad};
}

struct KCLABranchFunction : torch::autograd::Function<KCLABranchFunction> {
  static variable_list forward(
      AutogradContext* ctx, at::Tensor x, c10::optional<at::Tensor> u,
      at::Tensor w, at::Tensor z, at::Tensor gate, at::Tensor weight,
      at::Tensor bn_weight, at::Tensor bn_bias, at::Tensor keep,
      c10::optional<at::Tensor> running_mean,
      c10::optional<at::Tensor> running_var, c10::optional<double> momentum,
      bool use_batch_stats, bool one_call, double bn_eps, double eps,
      py::object tape_in, py::object tape_out, bool out_in_place,
      py::object x_handoff) {
    const auto dtype = x.scalar_type();
    const auto c = x.size(1);
    // out of place: the incoming state stays intact until it is known
    // whether backward recovers it by inversion (release_invertible)
    at::Tensor u_next = at::empty_like(x);
    at::Tensor out = out_in_place ? x : at::empty_like(x);
    at::Tensor mask = bit_mask(x);
    const at::Tensor rm = running_mean.value_or(at::Tensor());
    const at::Tensor rv = running_var.value_or(at::Tensor());
    at::Tensor mean, invstd, scale, shift;
    if (use_batch_stats && one_call) {
      at::Tensor bn_stats = at::empty({4, c}, x.options());
      mean = bn_stats[0], invstd = bn_stats[1], scale = bn_stats[2];
      shift = bn_stats[3];
      kcla_branch_train_forward(
          x, u, w, z, gate, weight, bn_weight.to(dtype).contiguous(),
          bn_bias.to(dtype).contiguous(),
          momentum ? running_mean : c10::nullopt,
          momentum ? running_var : c10::nullopt, keep, u_next, out, mask,
          mean, invstd, scale, shift, momentum.value_or(0.0), bn_eps, eps);
    } else {
      auto saved = branch_forward_per_kernel(
          x, u, w, z, gate, weight, bn_weight, bn_bias, rm, rv, keep,
          momentum, use_batch_stats, bn_eps, eps, u_next, out, mask);
      mean = saved[0], invstd = saved[1], scale = saved[2], shift = saved[3];
    }
    if (out_in_place) ctx->mark_dirty({x});
    ctx->save_for_backward({out, tape_out.is_none() ? u_next : at::Tensor(),
                            w, z, gate, weight, keep, mask, mean, invstd,
                            scale, shift});
    ctx->set_materialize_grads(false);
    keep_object(ctx, "tape_in", tape_in);
    keep_object(ctx, "tape_out", tape_out);
    keep_object(ctx, "x_handoff", x_handoff);
    ctx->saved_data["has_u"] = u.has_value();
    ctx->saved_data["use_batch_stats"] = use_batch_stats;
    ctx->saved_data["one_call"] = one_call;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["bn_dtype"] = bn_weight.scalar_type();
    return {out, u_next};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return first_order_backward(grads, [&]() -> variable_list {
      variable_list saved = ctx->get_saved_variables();
      const py::object* tape_in = kept_object(ctx, "tape_in");
      const py::object* tape_out = kept_object(ctx, "tape_out");
      const bool one_call = ctx->saved_data["one_call"].toBool();
      const bool use_batch_stats =
          ctx->saved_data["use_batch_stats"].toBool();
      const double eps = ctx->saved_data["eps"].toDouble();
      const at::Tensor& out = saved[kOut];
      at::Tensor u_next = saved[kUNext];
      bool writable = false;
      bool grad_u_owned = false;
      // the incoming state is recovered here unless the tape kept it
      bool invert = false;
      c10::optional<at::Tensor> grad_u_next;
      if (grads[1].defined()) grad_u_next = grads[1].contiguous();
      if (tape_out || tape_in) {
        py::gil_scoped_acquire gil;
        if (tape_out) {
          auto taken = tape_out->attr("take")().cast<py::tuple>();
          u_next = taken[0].cast<at::Tensor>();
          writable = taken[1].cast<bool>();
          // the successor's own gradient of u_next: overwritten with grad_u
          grad_u_owned = owns(tape_out->attr("grad_u"),
                              grad_u_next.value_or(at::Tensor()));
        }
        invert = tape_in && tape_in->attr("kept").is_none();
      }
      const at::Tensor grad_out =
          grads[0].defined() ? grads[0].contiguous() : at::zeros_like(out);
      c10::optional<at::Tensor> u_prev;
      if (invert) u_prev = writable ? u_next : at::empty_like(u_next);
      at::Tensor grad_x = at::empty_like(out);
      c10::optional<at::Tensor> grad_u;
      if (ctx->saved_data["has_u"].toBool() && ctx->needs_input_grad(1))
        grad_u = grad_u_owned && one_call ? *grad_u_next
                                          : at::empty_like(out);
      BranchGrads g;
      if (one_call) {
        const at::Tensor &w = saved[kW], &scale = saved[kScale];
        at::Tensor heads = at::empty({3, w.size(0), w.size(1)}, w.options());
        at::Tensor bn_grads = at::empty({2, scale.size(0)}, scale.options());
        g = {heads[0], heads[1], heads[2], at::empty_like(saved[kWeight]),
             bn_grads[0], bn_grads[1]};
        kcla_branch_train_backward(
            grad_out, grad_u_next, out, u_next, w, saved[kZ], saved[kGate],
            saved[kWeight], scale, saved[kShift], saved[kKeep], saved[kMask],
            saved[kMean], saved[kInvstd], grad_x, grad_u, u_prev, g.w, g.z,
            g.gate, g.weight, g.bn_weight, g.bn_bias, use_batch_stats, eps);
      } else {
        g = branch_backward_per_kernel(saved, grad_out, grad_u_next, u_next,
                                       grad_x, grad_u, u_prev,
                                       use_batch_stats, eps);
      }
      const py::object* x_handoff = kept_object(ctx, "x_handoff");
      if (tape_in || x_handoff) {
        py::gil_scoped_acquire gil;
        if (invert)  // the previous layer's state, recovered
          tape_in->attr("hand")(*u_prev, true);
        if (tape_in)
          tape_in->attr("grad_u").attr("give")(
              py_tensor(grad_u.value_or(at::Tensor())));
        if (x_handoff) x_handoff->attr("give")(grad_x);
      }
      const auto bn_dtype = ctx->saved_data["bn_dtype"].toScalarType();
      variable_list result(20);
      result[0] = grad_x;
      result[1] = grad_u.value_or(at::Tensor());
      result[2] = g.w, result[3] = g.z, result[4] = g.gate;
      result[5] = g.weight;
      result[6] = g.bn_weight.to(bn_dtype);
      result[7] = g.bn_bias.to(bn_dtype);
      return result;
    });
  }
};

}  // namespace

std::vector<at::Tensor> kcla_relu_pool_autograd(
    at::Tensor s, c10::optional<at::Tensor> residual, py::object handoff,
    bool grad_in_place) {
  return ReLUPoolFunction::apply(s, residual, handoff, grad_in_place);
}

std::vector<at::Tensor> kcla_branch_autograd(
    at::Tensor x, c10::optional<at::Tensor> u, at::Tensor w, at::Tensor z,
    at::Tensor gate, at::Tensor weight, at::Tensor bn_weight,
    at::Tensor bn_bias, at::Tensor keep,
    c10::optional<at::Tensor> running_mean,
    c10::optional<at::Tensor> running_var, c10::optional<double> momentum,
    bool use_batch_stats, bool one_call, double bn_eps, double eps,
    py::object tape_in, py::object tape_out, bool out_in_place,
    py::object x_handoff, c10::optional<at::Tensor> z_floor,
    double growth_limit) {
  auto result = KCLABranchFunction::apply(
      x, u, w, z, gate, weight, bn_weight, bn_bias, keep, running_mean,
      running_var, momentum, use_batch_stats, one_call, bn_eps, eps, tape_in,
      tape_out, out_in_place, x_handoff);
  if (z_floor) {
    TORCH_CHECK(z_floor->sizes() == z.sizes() &&
                    z_floor->scalar_type() == z.scalar_type() &&
                    z_floor->device() == z.device(),
                "kcla_branch_autograd: z_floor must match z ",
                z.sizes(), " (", z.scalar_type(), ", ", z.device(),
                "), got ", z_floor->sizes(), " (",
                z_floor->scalar_type(), ", ", z_floor->device(), ")");
    const at::Tensor zc = z.detach().contiguous();
    at::Tensor floor_out = at::empty_like(zc);
    at::Tensor flag = at::empty({}, z.options().dtype(at::kBool));
    kcla_state_growth_impl(zc, z_floor->contiguous(), floor_out, flag,
                           growth_limit);
    result.push_back(flag);
    result.push_back(floor_out);
  }
  return result;
}
