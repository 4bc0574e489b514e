// Python bindings of kcla_mm._ext.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "kcla_state_impl.hpp"
#include "pytorch_device_registry.hpp"

// Device types ("cpu", "cuda") for which the state op has an implementation.
std::vector<std::string> device_types() {
  std::vector<std::string> types;
  for (auto type : {at::kCPU, at::kCUDA}) {
    if (DEVICE_REGISTRY(kcla_state_forward_impl).Find(type) != nullptr &&
        DEVICE_REGISTRY(kcla_state_backward_impl).Find(type) != nullptr) {
      types.push_back(c10::DeviceTypeName(type, /*lower_case=*/true));
    }
  }
  return types;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("device_types", &device_types,
        "device types with a compiled implementation");
  m.def("kcla_state_forward", &kcla_state_forward,
        "u_next = u + w * x; agg = u_next / (z + eps)", py::arg("x"),
        py::arg("u"), py::arg("w"), py::arg("z"), py::arg("u_next"),
        py::arg("agg"), py::arg("eps"));
  m.def("kcla_state_backward", &kcla_state_backward,
        "gradients of kcla_state_forward", py::arg("grad_u_next"),
        py::arg("grad_agg"), py::arg("x"), py::arg("w"), py::arg("z"),
        py::arg("agg"), py::arg("grad_x"), py::arg("grad_u"),
        py::arg("grad_w"), py::arg("grad_z"), py::arg("eps"));
}
