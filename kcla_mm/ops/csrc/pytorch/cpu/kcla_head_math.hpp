// Per-head scalar maths shared by the CPU kernels (docs/method.md §2, steps
// 1-3, and §3 d): the ECA channel convolution, its transpose and the layer
// weight, in double. Scalar code on a few thousand values, compiled once
// for every ISA copy of the map kernels.
#ifndef KCLA_HEAD_MATH_HPP
#define KCLA_HEAD_MATH_HPP
#include <algorithm>
#include <cmath>
#include <cstdint>

// out (C,) = the zero-padded cross-correlation of pooled (C,) with an ECA
// kernel of k (odd) elements.
template <typename K, typename P>
void eca(const K* kernel, int64_t k, const P* pooled, int64_t C,
         double* out) {
  const int64_t pad = (k - 1) / 2;
  for (int64_t c = 0; c < C; ++c) {
    double v = 0;
    for (int64_t t = std::max<int64_t>(0, pad - c);
         t < std::min<int64_t>(k, C + pad - c); ++t) {
      v += double(kernel[t]) * double(pooled[c + t - pad]);
    }
    out[c] = v;
  }
}

// The transpose of eca for the gradient `grad_out` (C,) of its output:
// grad_pooled (C,) is overwritten, grad_kernel (k,) accumulated.
template <typename K, typename P>
void eca_backward(const K* kernel, int64_t k, const P* pooled, int64_t C,
                  const double* grad_out, double* grad_pooled,
                  double* grad_kernel) {
  const int64_t pad = (k - 1) / 2;
  for (int64_t j = 0; j < C; ++j) {
    double gp = 0;
    for (int64_t t = std::max<int64_t>(0, j + pad - C + 1);
         t < std::min<int64_t>(k, j + pad + 1); ++t) {
      const int64_t c = j - t + pad;
      gp += double(kernel[t]) * grad_out[c];
      grad_kernel[t] += grad_out[c] * double(pooled[j]);
    }
    grad_pooled[j] = gp;
  }
}

// A head's layer weight from its key's norm (docs/method.md §2, step 3):
// exp(min(|K_g| / norm_d_g, max_log)).
inline double layer_weight(double key_norm, double norm_d, double max_log) {
  return std::exp(std::min(key_norm / norm_d, max_log));
}
#endif  // KCLA_HEAD_MATH_HPP
