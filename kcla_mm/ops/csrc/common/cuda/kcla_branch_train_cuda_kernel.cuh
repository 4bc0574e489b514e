// CUDA kernels of the one-call training branch's per-channel glue
// (kcla_branch_train_forward_impl / _backward_impl, common/
// kcla_branch_impl.hpp), between the per-pass branch kernels: BN's batch
// statistics, their fold and the running update; the gradient sums over
// the batch and the heads. One thread per channel (or per sample and
// head), sums in double in a fixed order (deterministic, no atomics).
#ifndef KCLA_BRANCH_TRAIN_CUDA_KERNEL_CUH
#define KCLA_BRANCH_TRAIN_CUDA_KERNEL_CUH
#include <cstdint>

#include "kcla_cuda_helper.cuh"

// Per channel, from the per-plane (mean, sum of squared deviations) in
// stats (B, C, 2) (Chan et al.'s combination): the batch mean and invstd,
// BN folded (scale, shift), and the running statistics (when given)
// updated as nn.BatchNorm2d does.
template <typename T>
__global__ void branch_fold_stats_kernel(
    const int64_t B, const int64_t C, const int64_t hw,
    const T* __restrict__ stats, const T* __restrict__ bn_weight,
    const T* __restrict__ bn_bias, T* running_mean, T* running_var,
    const double momentum, const double bn_eps, T* __restrict__ mean,
    T* __restrict__ invstd, T* __restrict__ scale, T* __restrict__ shift) {
  KCLA_CUDA_1D_KERNEL_LOOP(c, C) {
    double mu = 0, m2 = 0;
    for (int64_t b = 0; b < B; ++b) mu += double(stats[(b * C + c) * 2]);
    mu /= double(B);
    for (int64_t b = 0; b < B; ++b) {
      const double d = double(stats[(b * C + c) * 2]) - mu;
      m2 += double(stats[(b * C + c) * 2 + 1]) + double(hw) * d * d;
    }
    const double n = double(B * hw), var = m2 / n;
    if (running_mean != nullptr) {
      running_mean[c] =
          T((1 - momentum) * double(running_mean[c]) + momentum * mu);
      running_var[c] = T((1 - momentum) * double(running_var[c]) +
                         momentum * var * n / fmax(n - 1, 1.0));
    }
    const double is = 1.0 / sqrt(var + bn_eps);
    const double sc = double(bn_weight[c]) * is;
    mean[c] = T(mu);
    invstd[c] = T(is);
    scale[c] = T(sc);
    shift[c] = T(double(bn_bias[c]) - mu * sc);
  }
}

// Per channel: BN's gradient terms alpha, beta (zeros with running
// statistics, bn_sums null) and, in sums (2, C), the sums of g and of
// g * x_hat (the BN parameters' gradients).
template <typename T>
__global__ void branch_bn_terms_kernel(const int64_t B, const int64_t C,
                                       const int64_t n,
                                       const T* __restrict__ bn_sums,
                                       const T* __restrict__ scale,
                                       const T* __restrict__ invstd,
                                       T* __restrict__ alpha,
                                       T* __restrict__ beta,
                                       double* __restrict__ sums) {
  KCLA_CUDA_1D_KERNEL_LOOP(c, C) {
    if (bn_sums == nullptr) {
      alpha[c] = beta[c] = T(0);
      continue;
    }
    double sg = 0, sx = 0;
    for (int64_t b = 0; b < B; ++b) {
      sg += double(bn_sums[(b * C + c) * 2]);
      sx += double(bn_sums[(b * C + c) * 2 + 1]);
    }
    const double is = invstd[c], sc = scale[c];
    sx *= is;
    sums[c] = sg;
    sums[C + c] = sx;
    alpha[c] = T(-sc * sg / double(n));
    beta[c] = T(-sc * is * sx / double(n));
  }
}

// After the backward pass: per channel, the BN parameters' gradients (from
// sums with batch statistics, else from plane_bn_sums (B, C, 2)) and the
// depthwise kernel's (from weight_sums (B, C, 9)); per sample and head,
// the heads' gradients (from head_sums (B, C, 3)).
template <typename T>
__global__ void branch_grad_sums_kernel(
    const int64_t B, const int64_t C, const int64_t G, const bool batch_stats,
    const double* __restrict__ sums, const T* __restrict__ plane_bn_sums,
    const T* __restrict__ invstd, const T* __restrict__ head_sums,
    const T* __restrict__ weight_sums, T* __restrict__ grad_w,
    T* __restrict__ grad_z, T* __restrict__ grad_gate,
    T* __restrict__ grad_weight, T* __restrict__ grad_bn_weight,
    T* __restrict__ grad_bn_bias) {
  KCLA_CUDA_1D_KERNEL_LOOP(i, C + B * G) {
    if (i < C) {
      const int64_t c = i;
      double sg, sx;
      if (batch_stats) {
        sg = sums[c];
        sx = sums[C + c];
      } else {
        sg = sx = 0;
        for (int64_t b = 0; b < B; ++b) {
          sg += double(plane_bn_sums[(b * C + c) * 2]);
          sx += double(plane_bn_sums[(b * C + c) * 2 + 1]);
        }
        sx *= double(invstd[c]);
      }
      grad_bn_weight[c] = T(sx);
      grad_bn_bias[c] = T(sg);
      for (int64_t t = 0; t < 9; ++t) {
        double s = 0;
        for (int64_t b = 0; b < B; ++b)
          s += double(weight_sums[(b * C + c) * 9 + t]);
        grad_weight[c * 9 + t] = T(s);
      }
    } else {
      const int64_t n = i - C, b = n / G, g = n % G, d = C / G;
      double s[3] = {0, 0, 0};
      for (int64_t c = g * d; c < (g + 1) * d; ++c)
        for (int64_t j = 0; j < 3; ++j)
          s[j] += double(head_sums[(b * C + c) * 3 + j]);
      grad_w[n] = T(s[0]);
      grad_z[n] = T(s[1]);
      grad_gate[n] = T(s[2]);
    }
  }
}
#endif  // KCLA_BRANCH_TRAIN_CUDA_KERNEL_CUH
