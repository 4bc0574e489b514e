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

// Both checks above: `t` contiguous, on `ref`'s device, of its dtype.
inline void check_operand(const at::Tensor& t, const char* op,
                          const char* name, const at::Tensor& ref,
                          const char* ref_name) {
  check_contiguous(t, op, name);
  check_same_device_dtype(t, name, ref, ref_name, op);
}

// The data pointer of `t`, or nullptr when `t` is undefined (optional
// arguments).
template <typename T>
T* data_ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// Checks every argument of an op against the feature map `x` (B, C, H, W)
// and the per-head tensor `w` (B, G), naming the bad argument. Every tensor
// must be contiguous, on `x`'s device and of its dtype: float32/float64, or
// any floating type with `any_float`.
class FeatureArgChecker {
 public:
  FeatureArgChecker(const char* op, const at::Tensor& x,
                    const at::Tensor& w = at::Tensor(), bool any_float = false,
                    const char* x_name = "x", const char* w_name = "w")
      : op_(op), x_(x), w_(w), x_name_(x_name), w_name_(w_name) {
    check_contiguous(x, op, x_name);
    TORCH_CHECK(x.dim() == 4, op, ": argument `", x_name,
                "` must be 4-D (B, C, H, W), got ", x.sizes());
    if (any_float) {
      TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": argument `",
                  x_name, "` must be floating point, got ",
                  x.scalar_type());
    } else {
      TORCH_CHECK(x.scalar_type() == at::kFloat ||
                      x.scalar_type() == at::kDouble,
                  op, ": argument `", x_name,
                  "` must be float32 or float64, got ",
                  x.scalar_type());
    }
    if (!w.defined()) return;  // ops without per-head arguments
    check_operand(w, op, w_name, x, x_name);
    TORCH_CHECK(w.dim() == 2 && w.size(0) == x.size(0) && w.size(1) > 0 &&
                    x.size(1) % w.size(1) == 0,
                op, ": argument `", w_name, "` must be (B, G) with B = ",
                x.size(0),
                " and G dividing C = ", x.size(1), ", got ", w.sizes());
  }
  void map(const at::Tensor& t, const char* name) const {
    if (!t.defined()) return;
    check(t, name);
    TORCH_CHECK(t.sizes() == x_.sizes(), op_, ": argument `", name,
                "` must have the shape of `", x_name_, "` ", x_.sizes(),
                ", got ",
                t.sizes());
  }
  void heads(const at::Tensor& t, const char* name) const {
    check(t, name);
    TORCH_CHECK(t.sizes() == w_.sizes(), op_, ": argument `", name,
                "` must have the shape of `", w_name_, "` ", w_.sizes(),
                ", got ",
                t.sizes());
  }
  void channels(const at::Tensor& t, const char* name) const {
    check(t, name);
    TORCH_CHECK(t.dim() == 1 && t.size(0) == x_.size(1), op_, ": argument `",
                name, "` must be (C,) with C = ", x_.size(1), ", got ",
                t.sizes());
  }
  void batch(const at::Tensor& t, const char* name) const {
    check(t, name);
    TORCH_CHECK(t.dim() == 1 && t.size(0) == x_.size(0), op_, ": argument `",
                name, "` must be (B,) with B = ", x_.size(0), ", got ",
                t.sizes());
  }
  void relu_mask(const at::Tensor& t, const char* name) const {
    check_contiguous(t, op_, name);
    TORCH_CHECK(t.device() == x_.device() && t.scalar_type() == at::kByte,
                op_, ": argument `", name, "` must be uint8 on ",
                x_.device(), ", got ", t.scalar_type(), " on ", t.device());
    const int64_t bytes = (x_.size(2) * x_.size(3) + 7) / 8;
    TORCH_CHECK(t.dim() == 3 && t.size(0) == x_.size(0) &&
                    t.size(1) == x_.size(1) && t.size(2) == bytes,
                op_, ": argument `", name, "` must be (B, C, ceil(H * W / 8))"
                " = (", x_.size(0), ", ", x_.size(1), ", ", bytes, "), got ",
                t.sizes());
  }
  // (B, C) when k == 0, else (B, C, k): per-plane values.
  void planes(const at::Tensor& t, const char* name, int64_t k = 0) const {
    check(t, name);
    const bool ok = k == 0 ? t.dim() == 2 : t.dim() == 3 && t.size(2) == k;
    TORCH_CHECK(ok && t.size(0) == x_.size(0) && t.size(1) == x_.size(1),
                op_, ": argument `", name, "` must be (B, C",
                k == 0 ? std::string() : ", " + std::to_string(k),
                ") with B = ", x_.size(0), ", C = ", x_.size(1), ", got ",
                t.sizes());
  }
  void kernel(const at::Tensor& t, const char* name) const {
    check(t, name);
    TORCH_CHECK(t.dim() == 4 && t.size(0) == x_.size(1) && t.size(1) == 1 &&
                    t.size(2) == 3 && t.size(3) == 3,
                op_, ": argument `", name, "` must be (C, 1, 3, 3) with C = ",
                x_.size(1), ", got ", t.sizes());
  }

 private:
  void check(const at::Tensor& t, const char* name) const {
    check_operand(t, op_, name, x_, x_name_);
  }
  const char* op_;
  const at::Tensor x_;
  const at::Tensor w_;
  const char* x_name_;
  const char* w_name_;
};

#endif  // KCLA_PYTORCH_CPP_HELPER
