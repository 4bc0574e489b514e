// Shared checks for kcla_mm's C++ op entries.
#ifndef KCLA_PYTORCH_CPP_HELPER
#define KCLA_PYTORCH_CPP_HELPER
#include <torch/extension.h>

#include <string>

// Raise (as Python RuntimeError) unless `t` is a defined, contiguous tensor.
inline void check_contiguous(const at::Tensor& t, const char* op,
                             const char* name) {
  TORCH_CHECK(t.defined(), op, ": argument `", name, "` is undefined");
  TORCH_CHECK(t.is_contiguous(), op, ": argument `", name,
              "` must be contiguous (NCHW), got strides ", t.strides());
}

// Raise unless `t` lives on `ref`'s device and has its dtype.
inline void check_same_device_dtype(const at::Tensor& t, const char* name,
                                    const at::Tensor& ref,
                                    const char* ref_name, const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": argument `", name,
              "` is on ", t.device(), " but `", ref_name, "` is on ",
              ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": argument `", name,
              "` has dtype ", t.scalar_type(), " but `", ref_name,
              "` has dtype ", ref.scalar_type());
}

#endif  // KCLA_PYTORCH_CPP_HELPER
