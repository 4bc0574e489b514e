// CUDA kernels of the adapter's per-head scalars in training
// (common/kcla_adapter_impl.hpp has the maths; pytorch/cpu/kcla_adapter.cpp
// is the same computation on the CPU). In double, as there: a few
// passes over B * C values and the (ci, ci) Gram matrices, each kernel a
// thread per value or a block per sample; sums over the batch in a fixed
// order (deterministic, no atomics).
#ifndef KCLA_ADAPTER_CUDA_KERNEL_CUH
#define KCLA_ADAPTER_CUDA_KERNEL_CUH
#include <cstdint>

#include "kcla_cuda_helper.cuh"

// The operands as raw pointers (passed by value to every kernel).
template <typename T>
struct AdapterArgs {
  int64_t B, G, ci, co, C, Gi, din, k, pad, hw;
  bool bs;  // batch statistics
  double momentum, bn_eps, max_log;
  const T *um, *cov, *z_in, *weight, *gamma, *beta, *kk, *norm_d;
  T *rm, *rv;

  // the conv weight (identity where there is none)
  __device__ double w(int64_t g, int64_t o, int64_t i) const {
    if (weight == nullptr) return o == i ? 1.0 : 0.0;
    return double(weight[(g * co + o) * ci + i]);
  }
  // 1 / Z of input channel i of group g
  __device__ double inv_z(int64_t b, int64_t g, int64_t i) const {
    return 1.0 / double(z_in[b * Gi + (g * ci + i) / din]);
  }
  // W_b[o][i] = weight / Z
  __device__ double wb(int64_t b, int64_t g, int64_t o, int64_t i) const {
    return w(g, o, i) * inv_z(b, g, i);
  }
  // (cov / hw) W_b[o] at i (batch statistics)
  __device__ double cov_wb(int64_t b, int64_t g, int64_t o, int64_t i) const {
    const T* m = cov + ((b * G + g) * ci + i) * ci;
    double sum = 0;
    for (int64_t j = 0; j < ci; ++j) sum += double(m[j]) * wb(b, g, o, j);
    return sum / double(hw);
  }
};

// y = W_b um and (batch statistics) v = W_b^T (cov / hw) W_b per (b, c).
template <typename T>
__global__ void adapter_moments_kernel(const AdapterArgs<T> a, double* y,
                                       double* v) {
  KCLA_CUDA_1D_KERNEL_LOOP(n, a.B * a.C) {
    const int64_t b = n / a.C, c = n % a.C, g = c / a.co, o = c % a.co;
    double sy = 0, sv = 0;
    for (int64_t i = 0; i < a.ci; ++i) {
      const double wi = a.wb(b, g, o, i);
      sy += wi * double(a.um[(b * a.G + g) * a.ci + i]);
      if (a.bs) sv += wi * a.cov_wb(b, g, o, i);
    }
    y[n] = sy;
    if (a.bs) v[n] = sv;
  }
}

// Per channel: the mean and 1 / sqrt(var + eps) used (the batch's, updating
// the running statistics as nn.BatchNorm2d does, or the running ones).
template <typename T>
__global__ void adapter_bn_kernel(const AdapterArgs<T> a, const double* y,
                                  const double* v, T* mean, T* invstd) {
  KCLA_CUDA_1D_KERNEL_LOOP(c, a.C) {
    double mu, var;
    if (a.bs) {
      mu = var = 0;
      for (int64_t b = 0; b < a.B; ++b) mu += y[b * a.C + c];
      mu /= double(a.B);
      for (int64_t b = 0; b < a.B; ++b) {
        const double dy = y[b * a.C + c] - mu;
        var += v[b * a.C + c] + dy * dy;
      }
      var /= double(a.B);
      if (a.rm != nullptr && a.momentum >= 0) {
        const double n = double(a.B * a.hw), m = a.momentum;
        a.rm[c] = T((1 - m) * double(a.rm[c]) + m * mu);
        a.rv[c] = T((1 - m) * double(a.rv[c]) +
                    m * var * n / fmax(n - 1, 1.0));
      }
    } else {
      mu = double(a.rm[c]);
      var = double(a.rv[c]);
    }
    mean[c] = T(mu);
    invstd[c] = T(1.0 / sqrt(var + a.bn_eps));
  }
}

// One block per sample: pooled, the key (ECA), z, then mat, bias and aux.
// Shared memory: pooled, key (C each), z (G) doubles.
template <typename T>
__global__ void adapter_heads_kernel(const AdapterArgs<T> a, const double* y,
                                     const T* mean, const T* invstd, T* mat,
                                     T* bias, T* z_out, T* aux) {
  extern __shared__ double smem[];
  const int64_t C = a.C, co = a.co, ci = a.ci, b = blockIdx.x;
  double *pooled = smem, *key = pooled + C, *zs = key + C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    pooled[c] = double(a.gamma[c]) * double(invstd[c]) *
                    (y[b * C + c] - double(mean[c])) +
                double(a.beta[c]);
  __syncthreads();
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    double kv = 0;
    for (int64_t t = 0; t < a.k; ++t) {
      const int64_t j = c + t - a.pad;
      if (j >= 0 && j < C) kv += double(a.kk[t]) * pooled[j];
    }
    key[c] = kv;
  }
  __syncthreads();
  for (int64_t g = threadIdx.x; g < a.G; g += blockDim.x) {
    double k2 = 0;
    for (int64_t c = g * co; c < (g + 1) * co; ++c) k2 += key[c] * key[c];
    zs[g] = exp(fmin(sqrt(k2) / double(a.norm_d[g]), a.max_log));
    z_out[b * a.G + g] = T(zs[g]);
  }
  __syncthreads();
  const int64_t BC = a.B * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const double z = zs[c / co], sc = double(a.gamma[c]) * double(invstd[c]);
    const int64_t n = b * C + c;
    bias[n] = T(z * (a.bs ? pooled[c] : pooled[c] - sc * y[n]));
    aux[n] = T(y[n]);
    aux[BC + n] = T(pooled[c]);
    aux[2 * BC + n] = T(key[c]);
  }
  for (int64_t e = threadIdx.x; e < C * ci; e += blockDim.x) {
    const int64_t c = e / ci, i = e % ci;
    const double sc = double(a.gamma[c]) * double(invstd[c]);
    mat[b * C * ci + e] =
        T(zs[c / co] * sc * a.wb(b, c / co, c % co, i));
  }
}

// The backward's saved values and gradients.
template <typename T>
struct AdapterGradArgs {
  const T *mat_grad, *bias_grad, *z_grad, *aux, *mean, *invstd, *z_out;
  // per (b, c) doubles: gk, gbeta (first gpooled), gmean, gy; gkk (B, k);
  // gv (C); gzc (B, C')
  double *gk, *gbeta, *gmean, *gy, *gkk, *gv, *gzc;
};

// One block per sample: the gradients through mat, bias, z (the key's
// norm and the ECA) into per-sample partial sums. Shared memory: term,
// gkey (C each), gnorm, norm (G each) and the reduction's blockDim.x.
template <typename T>
__global__ void adapter_grad_heads_kernel(const AdapterArgs<T> a,
                                          const AdapterGradArgs<T> r) {
  extern __shared__ double smem[];
  const int64_t C = a.C, co = a.co, ci = a.ci, G = a.G, b = blockIdx.x;
  const int64_t BC = a.B * C;
  double *term = smem, *gkey = term + C, *gnorm = gkey + C;
  double *norm = gnorm + G, *red = norm + G;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const int64_t n = b * C + c, g = c / co, o = c % co;
    const double z = r.z_out[b * G + g];
    const double sc = double(a.gamma[c]) * double(r.invstd[c]);
    double mw = 0;
    for (int64_t i = 0; i < ci; ++i)
      mw += double(r.mat_grad[n * ci + i]) * a.wb(b, g, o, i);
    const double gbc = r.bias_grad[n], yc = r.aux[n], pc = r.aux[BC + n];
    term[c] = sc * mw + gbc * (a.bs ? pc : pc - sc * yc);
    r.gk[n] = z * mw - (a.bs ? 0.0 : gbc * z * yc);
    r.gbeta[n] = gbc * z;  // gpooled, before the key's term
    r.gy[n] = a.bs ? 0.0 : -gbc * z * sc;
  }
  __syncthreads();
  for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
    double gzt = r.z_grad != nullptr ? double(r.z_grad[b * G + g]) : 0.0;
    double k2 = 0;
    for (int64_t c = g * co; c < (g + 1) * co; ++c) {
      gzt += term[c];
      const double kc = r.aux[2 * BC + b * C + c];
      k2 += kc * kc;
    }
    norm[g] = sqrt(k2);
    const double nd = a.norm_d[g], z = r.z_out[b * G + g];
    gnorm[g] = norm[g] / nd <= a.max_log ? gzt * z / nd : 0.0;
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const int64_t g = c / co;
    gkey[c] = norm[g] > 0
                  ? gnorm[g] * double(r.aux[2 * BC + b * C + c]) / norm[g]
                  : 0.0;
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    double geca = 0;  // the ECA's transpose
    for (int64_t t = 0; t < a.k; ++t) {
      const int64_t c = j - t + a.pad;
      if (c >= 0 && c < C) geca += double(a.kk[t]) * gkey[c];
    }
    const int64_t n = b * C + j;
    const double gp = r.gbeta[n] + geca;
    const double sc = double(a.gamma[j]) * double(r.invstd[j]);
    r.gbeta[n] = gp;
    r.gk[n] += gp * (double(r.aux[n]) - double(r.mean[j]));
    r.gy[n] += gp * sc;
    r.gmean[n] = -gp * sc;
  }
  for (int64_t t = 0; t < a.k; ++t) {
    double s = 0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const int64_t j = c + t - a.pad;
      if (j >= 0 && j < C) s += gkey[c] * double(r.aux[BC + b * C + j]);
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) r.gkk[b * a.k + t] = s;
  }
}

// Per channel: the batch sums (gamma's and beta's gradients) and, with
// batch statistics, var's and mean's terms into gy; per kernel tap: gkk.
template <typename T>
__global__ void adapter_grad_bn_kernel(const AdapterArgs<T> a,
                                       const AdapterGradArgs<T> r,
                                       T* grad_gamma, T* grad_beta,
                                       T* grad_kk) {
  KCLA_CUDA_1D_KERNEL_LOOP(c, a.C) {
    double gk = 0, gbeta = 0, gmean = 0;
    for (int64_t b = 0; b < a.B; ++b) {
      gk += r.gk[b * a.C + c];
      gbeta += r.gbeta[b * a.C + c];
      gmean += r.gmean[b * a.C + c];
    }
    const double is = r.invstd[c], sc = double(a.gamma[c]) * is;
    grad_gamma[c] = T(gk * is);
    grad_beta[c] = T(gbeta);
    if (!a.bs) continue;
    const double gvar = -0.5 * gk * sc * is * is;
    r.gv[c] = gvar / double(a.B);
    for (int64_t b = 0; b < a.B; ++b) {
      const int64_t n = b * a.C + c;
      r.gy[n] += (2 * gvar * (double(r.aux[n]) - double(r.mean[c])) + gmean) /
                 double(a.B);
    }
  }
  KCLA_CUDA_1D_KERNEL_LOOP(t, a.k) {
    double s = 0;
    for (int64_t b = 0; b < a.B; ++b) s += r.gkk[b * a.k + t];
    grad_kk[t] = T(s);
  }
}

// W_b's gradient at (b, g, o, i).
template <typename T>
__device__ double adapter_grad_wb(const AdapterArgs<T>& a,
                                  const AdapterGradArgs<T>& r, int64_t b,
                                  int64_t g, int64_t o, int64_t i) {
  const int64_t c = g * a.co + o, n = b * a.C + c;
  const double sc = double(a.gamma[c]) * double(r.invstd[c]);
  double gw = double(r.mat_grad[n * a.ci + i]) * double(r.z_out[b * a.G + g]) *
                  sc +
              r.gy[n] * double(a.um[(b * a.G + g) * a.ci + i]);
  if (a.bs) gw += 2 * r.gv[c] * a.cov_wb(b, g, o, i);
  return gw;
}

// One block per (b, g): r (B, G, ci), s (B, G, ci, ci; batch statistics)
// and Z's gradient per input channel (gzc).
template <typename T>
__global__ void adapter_grad_state_kernel(const AdapterArgs<T> a,
                                          const AdapterGradArgs<T> r, T* pr,
                                          T* ps) {
  const int64_t bg = blockIdx.x, b = bg / a.G, g = bg % a.G, ci = a.ci;
  for (int64_t i = threadIdx.x; i < ci; i += blockDim.x) {
    double ri = 0, giz = 0;
    for (int64_t o = 0; o < a.co; ++o) {
      const int64_t c = g * a.co + o, n = b * a.C + c;
      const double wbi = a.wb(b, g, o, i);
      ri += wbi * r.gy[n];
      if (a.bs)
        ri -= double(r.z_out[bg]) * double(a.gamma[c]) *
              double(r.invstd[c]) * wbi * double(r.bias_grad[n]);
      giz += adapter_grad_wb(a, r, b, g, o, i) * a.w(g, o, i);
    }
    pr[bg * ci + i] = T(ri / double(a.hw));
    const double iz = a.inv_z(b, g, i);
    r.gzc[b * a.G * ci + g * ci + i] = -giz * iz * iz;
  }
  if (!a.bs) return;
  for (int64_t e = threadIdx.x; e < ci * ci; e += blockDim.x) {
    const int64_t i = e / ci, j = e % ci;
    double s = 0;
    for (int64_t o = 0; o < a.co; ++o)
      s += r.gv[g * a.co + o] * a.wb(b, g, o, i) * a.wb(b, g, o, j);
    ps[bg * ci * ci + e] = T(2 * s / double(a.hw));
  }
}

// The conv weight's gradient (G, co, ci), a batch sum per element, and
// Z's per incoming head (B, Gi), a sum over its din input channels.
template <typename T>
__global__ void adapter_grad_params_kernel(const AdapterArgs<T> a,
                                           const AdapterGradArgs<T> r,
                                           T* grad_weight, T* grad_z_in) {
  if (grad_weight != nullptr) {
    KCLA_CUDA_1D_KERNEL_LOOP(e, a.G * a.co * a.ci) {
      const int64_t i = e % a.ci, o = (e / a.ci) % a.co, g = e / (a.ci * a.co);
      double s = 0;
      for (int64_t b = 0; b < a.B; ++b)
        s += adapter_grad_wb(a, r, b, g, o, i) * a.inv_z(b, g, i);
      grad_weight[e] = T(s);
    }
  }
  KCLA_CUDA_1D_KERNEL_LOOP(n, a.B * a.Gi) {
    const int64_t b = n / a.Gi, h = n % a.Gi, c_in = a.G * a.ci;
    double s = 0;
    for (int64_t c = h * a.din; c < (h + 1) * a.din; ++c)
      s += r.gzc[b * c_in + c];
    grad_z_in[n] = T(s);
  }
}
#endif  // KCLA_ADAPTER_CUDA_KERNEL_CUH
