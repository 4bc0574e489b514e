// Python bindings of kcla_mm._ext.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "kcla_branch_impl.hpp"
#include "kcla_state_impl.hpp"
#include "pytorch_device_registry.hpp"

// Device types ("cpu", "cuda") with a compiled implementation of every op
// of a group: "state" (kcla_state_*) or "branch" (kcla_branch_*,
// kcla_bn_relu_add_*).
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
          DEVICE_REGISTRY(kcla_branch_forward_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_branch_recompute_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_bn_relu_add_forward_impl).Find(type) !=
              nullptr &&
          DEVICE_REGISTRY(kcla_bn_relu_add_backward_impl).Find(type) !=
              nullptr &&
          DEVICE_REGISTRY(kcla_branch_backward_impl).Find(type) != nullptr &&
          DEVICE_REGISTRY(kcla_branch_inference_impl).Find(type) != nullptr;
    } else {
      TORCH_CHECK(false, "device_types: unknown op group '", group,
                  "', expected 'state' or 'branch'");
    }
    if (has_all) types.push_back(c10::DeviceTypeName(type, true));
  }
  return types;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("device_types", &device_types,
        "device types implementing every op of a group ('state', 'branch')",
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
  m.def("kcla_branch_forward", &kcla_branch_forward,
        "u_next = u + w x; o = gate * DWConv3x3(u_next / (z + eps))",
        py::arg("x"), py::arg("u"), py::arg("w"), py::arg("z"),
        py::arg("gate"), py::arg("weight"), py::arg("u_next"), py::arg("o"),
        py::arg("eps"));
  m.def("kcla_branch_recompute", &kcla_branch_recompute,
        "o = gate * DWConv3x3(u_next / (z + eps))", py::arg("u_next"),
        py::arg("z"), py::arg("gate"), py::arg("weight"), py::arg("o"),
        py::arg("eps"));
  m.def("kcla_bn_relu_add_forward", &kcla_bn_relu_add_forward,
        "out = x + keep * ReLU(scale * o + shift), mask = the ReLU's bits",
        py::arg("o"), py::arg("x"), py::arg("scale"), py::arg("shift"),
        py::arg("keep"), py::arg("out"), py::arg("mask"));
  m.def("kcla_bn_relu_add_backward", &kcla_bn_relu_add_backward,
        "gradient of kcla_bn_relu_add_forward w.r.t. o, with channel sums",
        py::arg("grad_out"), py::arg("o"), py::arg("scale"), py::arg("mask"),
        py::arg("keep"), py::arg("mean"), py::arg("grad_o"),
        py::arg("sum_grad"), py::arg("sum_grad_centered"));
  m.def("kcla_branch_backward", &kcla_branch_backward,
        "gradients of kcla_branch_forward", py::arg("grad_o"),
        py::arg("alpha"), py::arg("beta"), py::arg("mean"),
        py::arg("grad_u_next"),
        py::arg("grad_residual"), py::arg("x"), py::arg("u_next"),
        py::arg("w"), py::arg("z"), py::arg("gate"), py::arg("weight"),
        py::arg("grad_x"), py::arg("grad_u"), py::arg("grad_w"),
        py::arg("grad_z"), py::arg("grad_gate"), py::arg("grad_weight"),
        py::arg("eps"));
  m.def("kcla_branch_inference", &kcla_branch_inference,
        "inference branch with folded BN; u_next may alias u",
        py::arg("x"), py::arg("u"), py::arg("w"), py::arg("z"),
        py::arg("gate"), py::arg("weight"), py::arg("scale"),
        py::arg("shift"), py::arg("u_next"), py::arg("out"), py::arg("eps"));
}
