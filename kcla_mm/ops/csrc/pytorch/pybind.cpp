// Python bindings of kcla_mm._ext.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "fused_backward.hpp"
#include "kcla_adapter_impl.hpp"
#include "kcla_branch_autograd.hpp"
#include "kcla_branch_impl.hpp"
#include "kcla_ops_autograd.hpp"
#include "kcla_state_impl.hpp"
#include "pytorch_device_registry.hpp"

// Device types ("cpu", "cuda") with a compiled implementation of every op
// of a group: "state" (kcla_state_*), "branch" (kcla_relu_pool_*,
// kcla_branch_*, the state's growth check) or "layer" (kcla_branch_train_*,
// kcla_layer_inference, kcla_heads_*, kcla_adapter_inference,
// kcla_adapter_heads_*).
std::vector<std::string> device_types(const std::string& group) {
  std::vector<std::string> types;
  for (auto type : {at::kCPU, at::kCUDA}) {
    bool has_all;
    if (group == "state") {
      has_all =
          DEVICE_REGISTRY(kcla_state_forward_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_state_backward_impl).Find(type) != nullptr;
    } else if (group == "branch") {
      has_all =
          DEVICE_REGISTRY(kcla_relu_pool_forward_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_relu_pool_backward_impl).Find(type) !=
              nullptr &&
          DEVICE_REGISTRY(kcla_branch_stats_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_branch_forward_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_branch_apply_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_branch_bn_sums_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_branch_backward_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_state_growth_impl).Find(type) != nullptr;
    } else if (group == "layer") {
      has_all =
          DEVICE_REGISTRY(kcla_branch_train_forward_impl).Find(type) !=
              nullptr &&
          DEVICE_REGISTRY(kcla_branch_train_backward_impl).Find(type) !=
              nullptr &&
          DEVICE_REGISTRY(kcla_layer_inference_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_heads_forward_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_heads_backward_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_adapter_inference_impl).Find(type) !=
              nullptr &&
          DEVICE_REGISTRY(kcla_adapter_heads_forward_impl).Find(type) !=
              nullptr &&
          DEVICE_REGISTRY(kcla_adapter_heads_backward_impl).Find(type) !=
              nullptr;
    } else {
      TORCH_CHECK(false, "device_types: unknown op group '", group,
                  "', expected 'state', 'branch' or 'layer'");
    }
    if (has_all) types.push_back(c10::DeviceTypeName(type, true));
  }
  return types;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("device_types", &device_types,
        "device types implementing every op of a group ('state', 'branch', "
        "'layer')",
        py::arg("group") = "state");
  m.def("kcla_state_forward", &kcla_state_forward,
        "u_next = u + w * x; agg = u_next / (z + eps)", py::arg("x"),
        py::arg("u"), py::arg("w"), py::arg("z"), py::arg("u_next"),
        py::arg("agg"), py::arg("eps"));
  m.def("kcla_state_backward", &kcla_state_backward,
        "gradients of kcla_state_forward", py::arg("grad_u_next"),
        py::arg("grad_agg"), py::arg("x"), py::arg("w"), py::arg("z"),
        py::arg("agg"), py::arg("grad_x"), py::arg("grad_u"),
        py::arg("grad_w"), py::arg("grad_z"), py::arg("eps"));
  m.def("cpu_isa", &kcla_cpu_isa,
        "instruction set of the CPU kernels: 'avx2' or 'base'");
  m.def("kcla_relu_pool_forward", &kcla_relu_pool_forward,
        "s = ReLU(s + residual) in place, its bit mask and its mean per "
        "plane",
        py::arg("s"), py::arg("residual"), py::arg("mask"),
        py::arg("pooled"));
  m.def("kcla_relu_pool_backward", &kcla_relu_pool_backward,
        "grad_s = mask * (grad_x + grad_pooled / (H * W))",
        py::arg("grad_x"), py::arg("grad_pooled"), py::arg("mask"),
        py::arg("grad_s"));
  m.def("set_fused_backward_errors", &set_fused_backward_errors,
        "the messages the autograd ops' backwards raise",
        py::arg("second_order"), py::arg("batched_grads"));
  m.def("kcla_relu_pool_autograd", &kcla_relu_pool_autograd,
        "relu_pool's autograd op: (x, pooled)", py::arg("s"),
        py::arg("residual"), py::arg("handoff"), py::arg("grad_in_place"));
  m.def("kcla_branch_autograd", &kcla_branch_autograd,
        "the branch's autograd op: (out, u_next), then with z_floor the "
        "state's growth (flag, floor)", py::arg("x"),
        py::arg("u"), py::arg("w"), py::arg("z"), py::arg("gate"),
        py::arg("weight"), py::arg("bn_weight"), py::arg("bn_bias"),
        py::arg("keep"), py::arg("running_mean"), py::arg("running_var"),
        py::arg("momentum"), py::arg("use_batch_stats"), py::arg("one_call"),
        py::arg("bn_eps"), py::arg("eps"), py::arg("tape_in"),
        py::arg("tape_out"), py::arg("out_in_place"), py::arg("x_handoff"),
        py::arg("z_floor"), py::arg("growth_limit"));
  m.def("kcla_heads_autograd", &kcla_heads_autograd,
        "the heads' autograd op: (w, z_next, gate)", py::arg("pooled"),
        py::arg("z"), py::arg("q_kernel"), py::arg("k_kernel"),
        py::arg("norm_d"), py::arg("gate_weight"), py::arg("key_eps"),
        py::arg("max_log_weight"));
  m.def("kcla_state_autograd", &kcla_state_autograd,
        "the state update's autograd op: (u_next, agg)", py::arg("x"),
        py::arg("u"), py::arg("w"), py::arg("z"), py::arg("eps"));
  m.def("kcla_branch_stats", &kcla_branch_stats,
        "u_next = u + w x and per-plane (mean, M2) of "
        "o = gate * DWConv3x3(u_next / (z + eps))",
        py::arg("x"), py::arg("u"), py::arg("w"), py::arg("z"),
        py::arg("gate"), py::arg("weight"), py::arg("u_next"),
        py::arg("stats"), py::arg("eps"));
  m.def("kcla_branch_forward", &kcla_branch_forward,
        "u_next = u + w x; out = x + keep * ReLU(scale * o + shift); "
        "u_next may alias u, out may alias x",
        py::arg("x"), py::arg("u"), py::arg("w"), py::arg("z"),
        py::arg("gate"), py::arg("weight"), py::arg("scale"),
        py::arg("shift"), py::arg("keep"), py::arg("u_next"), py::arg("out"),
        py::arg("mask"), py::arg("eps"));
  m.def("kcla_branch_apply", &kcla_branch_apply,
        "out = x + keep * ReLU(scale * o + shift) from u_next",
        py::arg("x"), py::arg("u_next"), py::arg("z"), py::arg("gate"),
        py::arg("weight"), py::arg("scale"), py::arg("shift"),
        py::arg("keep"), py::arg("out"), py::arg("mask"), py::arg("eps"));
  m.def("kcla_branch_bn_sums", &kcla_branch_bn_sums,
        "per-plane (sum g, sum g * (o - mean)), g = grad_out * keep * mask",
        py::arg("grad_out"), py::arg("u_next"), py::arg("z"),
        py::arg("gate"), py::arg("weight"), py::arg("keep"), py::arg("mask"),
        py::arg("mean"), py::arg("bn_sums"), py::arg("eps"));
  m.def("kcla_branch_backward", &kcla_branch_backward,
        "gradients of the branch, per-plane partial sums, state inversion",
        py::arg("grad_out"), py::arg("grad_u_next"), py::arg("out"),
        py::arg("u_next"), py::arg("w"), py::arg("z"), py::arg("gate"),
        py::arg("weight"), py::arg("scale"), py::arg("shift"),
        py::arg("keep"), py::arg("mask"), py::arg("alpha"), py::arg("beta"),
        py::arg("mean"), py::arg("grad_x"), py::arg("grad_u"),
        py::arg("u_prev"), py::arg("bn_sums"), py::arg("head_sums"),
        py::arg("weight_sums"), py::arg("eps"));
  m.def("kcla_branch_train_forward", &kcla_branch_train_forward,
        "the training branch with BN's batch statistics in one call: "
        "u_next, out, mask, the statistics and BN folded; running "
        "statistics updated",
        py::arg("x"), py::arg("u"), py::arg("w"), py::arg("z"),
        py::arg("gate"), py::arg("weight"), py::arg("bn_weight"),
        py::arg("bn_bias"), py::arg("running_mean"), py::arg("running_var"),
        py::arg("keep"), py::arg("u_next"), py::arg("out"), py::arg("mask"),
        py::arg("mean"), py::arg("invstd"), py::arg("scale"),
        py::arg("shift"), py::arg("momentum"), py::arg("bn_eps"),
        py::arg("eps"));
  m.def("kcla_branch_train_backward", &kcla_branch_train_backward,
        "the whole training backward of the branch in one call, gradients "
        "reduced over batch and heads",
        py::arg("grad_out"), py::arg("grad_u_next"), py::arg("out"),
        py::arg("u_next"), py::arg("w"), py::arg("z"), py::arg("gate"),
        py::arg("weight"), py::arg("scale"), py::arg("shift"),
        py::arg("keep"), py::arg("mask"), py::arg("mean"), py::arg("invstd"),
        py::arg("grad_x"), py::arg("grad_u"), py::arg("u_prev"),
        py::arg("grad_w"), py::arg("grad_z"), py::arg("grad_gate"),
        py::arg("grad_weight"), py::arg("grad_bn_weight"),
        py::arg("grad_bn_bias"), py::arg("batch_stats"), py::arg("eps"));
  m.def("kcla_layer_inference", &kcla_layer_inference,
        "a whole KCLA layer in inference: ReLU(tail BN + residual) and GAP, "
        "the heads, then the branch, both eval BNs folded; out over s, "
        "u_next may alias u",
        py::arg("s"), py::arg("residual"), py::arg("tail_weight"),
        py::arg("tail_bias"), py::arg("tail_mean"), py::arg("tail_var"),
        py::arg("u"), py::arg("z"), py::arg("q_kernel"), py::arg("k_kernel"),
        py::arg("norm_d"), py::arg("gate_weight"), py::arg("weight"),
        py::arg("bn_weight"), py::arg("bn_bias"), py::arg("bn_mean"),
        py::arg("bn_var"), py::arg("u_next"), py::arg("w"),
        py::arg("z_next"), py::arg("gate"), py::arg("eps"),
        py::arg("key_eps"), py::arg("max_log_weight"), py::arg("bn_eps"),
        py::arg("tail_eps"));
  m.def("kcla_heads_forward", &kcla_heads_forward,
        "the KCLA heads from pooled features: w, z_next = z + w, gate",
        py::arg("pooled"), py::arg("z"), py::arg("q_kernel"),
        py::arg("k_kernel"), py::arg("norm_d"), py::arg("gate_weight"),
        py::arg("w"), py::arg("z_next"), py::arg("gate"), py::arg("key_eps"),
        py::arg("max_log_weight"));
  m.def("kcla_heads_backward", &kcla_heads_backward,
        "gradients of kcla_heads_forward (grad_w includes z_next's)",
        py::arg("pooled"), py::arg("q_kernel"), py::arg("k_kernel"),
        py::arg("norm_d"), py::arg("gate_weight"), py::arg("w"),
        py::arg("gate"), py::arg("grad_w"), py::arg("grad_gate"),
        py::arg("grad_pooled"), py::arg("grad_q_kernel"),
        py::arg("grad_k_kernel"), py::arg("grad_gate_weight"),
        py::arg("key_eps"), py::arg("max_log_weight"));
  m.def("kcla_adapter_inference", &kcla_adapter_inference,
        "the cross-stage state adapter in inference, its eval BN folded: "
        "u_out = z_out * BN(Conv1x1(U / Z)) at the stride",
        py::arg("u"), py::arg("z"), py::arg("weight"), py::arg("stride"),
        py::arg("bn_weight"), py::arg("bn_bias"), py::arg("bn_mean"),
        py::arg("bn_var"), py::arg("k_kernel"), py::arg("norm_d"),
        py::arg("u_out"), py::arg("z_out"), py::arg("bn_eps"),
        py::arg("max_log_weight"));
  m.def("kcla_adapter_autograd", &kcla_adapter_autograd,
        "the cross-stage state adapter with gradients (batch or running "
        "statistics): (U' = z BN(Conv1x1(U / Z)) at the stride, z)",
        py::arg("u"), py::arg("z"), py::arg("weight"), py::arg("bn_weight"),
        py::arg("bn_bias"), py::arg("running_mean"), py::arg("running_var"),
        py::arg("k_kernel"), py::arg("norm_d"), py::arg("stride"),
        py::arg("batch_stats"), py::arg("momentum"), py::arg("bn_eps"),
        py::arg("max_log_weight"));
}
