// A per-op table of device implementations, in the style of mmcv's
// pytorch_device_registry.hpp: device files REGISTER_DEVICE_IMPL their
// launcher for an op's `*_impl` declaration; the op entry calls
// DISPATCH_DEVICE_IMPL, which picks the launcher by the tensors' device.
#ifndef KCLA_PYTORCH_DEVICE_REGISTRY_H
#define KCLA_PYTORCH_DEVICE_REGISTRY_H
#include <torch/extension.h>

#include <string>
#include <type_traits>

template <typename F, F f>
class DeviceRegistry;

template <typename Ret, typename... Args, Ret (*f)(Args...)>
class DeviceRegistry<Ret (*)(Args...), f> {
 public:
  using FunctionType = Ret (*)(Args...);
  static const int MAX_DEVICE_TYPES =
      int8_t(at::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

  void Register(at::DeviceType device, FunctionType function) {
    funcs_[int8_t(device)] = function;
  }
  FunctionType Find(at::DeviceType device) const {
    return funcs_[int8_t(device)];
  }
  static DeviceRegistry& instance() {
    static DeviceRegistry inst;
    return inst;
  }

 private:
  DeviceRegistry() {
    for (int i = 0; i < MAX_DEVICE_TYPES; ++i) funcs_[i] = nullptr;
  }
  FunctionType funcs_[MAX_DEVICE_TYPES];
};

#define DEVICE_REGISTRY(key) DeviceRegistry<decltype(&(key)), key>::instance()

#define REGISTER_DEVICE_IMPL(key, device, value)           \
  struct key##_##device##_registerer {                     \
    key##_##device##_registerer() {                        \
      DEVICE_REGISTRY(key).Register(at::k##device, value); \
    }                                                      \
  };                                                       \
  static key##_##device##_registerer _##key##_##device##_registerer;

// The device of the first defined tensor argument (undefined = optional).
inline c10::optional<at::Device> first_defined_device() { return c10::nullopt; }
template <typename T, typename... Rest>
c10::optional<at::Device> first_defined_device(const T& arg,
                                               const Rest&... rest) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    if (arg.defined()) return arg.device();
  }
  return first_defined_device(rest...);
}

// All defined tensor arguments must share `device`.
inline bool all_on_device(const at::Device&) { return true; }
template <typename T, typename... Rest>
bool all_on_device(const at::Device& device, const T& arg,
                   const Rest&... rest) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    if (arg.defined() && arg.device() != device) return false;
  }
  return all_on_device(device, rest...);
}

template <typename R, typename... Args>
auto Dispatch(const R& registry, const char* name, Args&&... args) {
  auto device = first_defined_device(args...);
  TORCH_CHECK(device.has_value(), name, ": no tensor argument is defined");
  TORCH_CHECK(all_on_device(*device, args...), name,
              ": all tensor arguments must be on ", *device);
  auto f_ptr = registry.Find(device->type());
  TORCH_CHECK(f_ptr != nullptr, name, ": kcla_mm._ext was built without an ",
              "implementation for device ", device->type(),
              " (rebuild with FORCE_CUDA=1 for CUDA)");
  return f_ptr(std::forward<Args>(args)...);
}

#define DISPATCH_DEVICE_IMPL(key, ...) \
  Dispatch(DEVICE_REGISTRY(key), #key, __VA_ARGS__)

#endif  // KCLA_PYTORCH_DEVICE_REGISTRY_H
