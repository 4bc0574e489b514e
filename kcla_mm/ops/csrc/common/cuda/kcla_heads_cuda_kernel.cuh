// CUDA kernels of the KCLA heads (kcla_heads_forward_impl and
// kcla_heads_backward_impl, common/kcla_branch_impl.hpp): one block per
// sample, in double as the CPU kernels (a few thousand values per sample),
// q and the key in shared memory; the backward's kernel and gate-weight
// gradients as per-sample partial sums, added over the batch by a second
// kernel in a fixed order (deterministic, no atomics).
#ifndef KCLA_HEADS_CUDA_KERNEL_CUH
#define KCLA_HEADS_CUDA_KERNEL_CUH
#include <cstdint>

#include "kcla_cuda_helper.cuh"

struct HeadDims {
  int64_t C, G, d, k, pad;
  double key_eps, max_log;
};

// q, key (C,) = the ECA cross-correlations of one sample's pooled p (C,).
template <typename T>
__device__ void heads_eca(const T* p, const T* kq, const T* kk,
                          const HeadDims& hd, double* q, double* key) {
  for (int64_t c = threadIdx.x; c < hd.C; c += blockDim.x) {
    double vq = 0, vk = 0;
    for (int64_t t = 0; t < hd.k; ++t) {
      const int64_t j = c + t - hd.pad;
      if (j < 0 || j >= hd.C) continue;
      vq += double(kq[t]) * double(p[j]);
      vk += double(kk[t]) * double(p[j]);
    }
    q[c] = vq;
    key[c] = vk;
  }
}

// Head g's (|K_g|, <Q_g, K_g>).
__device__ inline void head_norm_dot(const double* q, const double* key,
                                     int64_t g, int64_t d, double* norm,
                                     double* qk) {
  double k2 = 0, dot = 0;
  for (int64_t c = g * d; c < (g + 1) * d; ++c) {
    k2 += key[c] * key[c];
    dot += q[c] * key[c];
  }
  *norm = sqrt(k2);
  *qk = dot;
}

// Shared memory: q, key (C each), rel (G) doubles.
template <typename T>
__global__ void kcla_heads_forward_cuda_kernel(
    const HeadDims hd, const T* __restrict__ pooled, const T* __restrict__ z,
    const T* __restrict__ kq, const T* __restrict__ kk,
    const T* __restrict__ norm_d, const T* __restrict__ gate_w,
    T* __restrict__ w, T* __restrict__ z_next, T* __restrict__ gate) {
  extern __shared__ double smem[];
  double *q = smem, *key = q + hd.C, *rel = key + hd.C;
  const int64_t b = blockIdx.x, G = hd.G;
  heads_eca(pooled + b * hd.C, kq, kk, hd, q, key);
  __syncthreads();
  for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
    double norm, qk;
    head_norm_dot(q, key, g, hd.d, &norm, &qk);
    const double wv = exp(fmin(norm / double(norm_d[g]), hd.max_log));
    w[b * G + g] = T(wv);
    z_next[b * G + g] = z != nullptr ? T(double(z[b * G + g]) + wv) : T(wv);
    rel[g] = qk / fmax(norm, hd.key_eps);
  }
  __syncthreads();
  for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
    double a = 0;
    for (int64_t j = 0; j < G; ++j) a += double(gate_w[g * G + j]) * rel[j];
    gate[b * G + g] = T(1.0 / (1.0 + exp(-a)));
  }
}

// Gradients of the forward from grad_w (w's plus z_next's) and grad_gate:
// grad_pooled (B, C) and, per sample, partial (B, 2k + G * G): the two ECA
// kernels' and gate_w's gradients. The clamps pass gradient where
// torch.clamp does (x <= max, |K| >= key_eps); |K| = 0 passes none.
// Shared memory: q, key (C each), da, dqk, dkn, rel (G each) and the
// reduction's blockDim.x doubles.
template <typename T>
__global__ void kcla_heads_backward_cuda_kernel(
    const HeadDims hd, const T* __restrict__ pooled, const T* __restrict__ kq,
    const T* __restrict__ kk, const T* __restrict__ norm_d,
    const T* __restrict__ gate_w, const T* __restrict__ w,
    const T* __restrict__ gate, const T* __restrict__ grad_w,
    const T* __restrict__ grad_gate, T* __restrict__ grad_pooled,
    double* __restrict__ partial) {
  extern __shared__ double smem[];
  const int64_t C = hd.C, G = hd.G, d = hd.d, k = hd.k, pad = hd.pad;
  double *q = smem, *key = q + C, *da = key + C, *dqk = da + G;
  double *dkn = dqk + G, *rel = dkn + G, *red = rel + G;
  const int64_t b = blockIdx.x;
  const T* p = pooled + b * C;
  heads_eca(p, kq, kk, hd, q, key);
  for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {  // dL/d(logit)
    const double gt = gate[b * G + g];
    da[g] = double(grad_gate[b * G + g]) * gt * (1.0 - gt);
  }
  __syncthreads();
  for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
    double norm, qk, dr = 0;
    head_norm_dot(q, key, g, d, &norm, &qk);
    for (int64_t j = 0; j < G; ++j) dr += double(gate_w[j * G + g]) * da[j];
    const double den = fmax(norm, hd.key_eps);
    rel[g] = qk / den;
    double dn = 0;  // dL/d|K_g|
    if (norm / double(norm_d[g]) <= hd.max_log)
      dn += double(grad_w[b * G + g]) * double(w[b * G + g]) /
            double(norm_d[g]);
    if (norm >= hd.key_eps) dn -= dr * qk / (den * den);
    dqk[g] = dr / den;
    dkn[g] = norm > 0 ? dn / norm : 0.0;
  }
  __syncthreads();
  // dq[c] = dqk_g key[c], dk[c] = dqk_g q[c] + dkn_g key[c] (g = c / d);
  // grad_pooled is the ECA convs' transposes of (dq, dk)
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    double gp = 0;
    for (int64_t t = 0; t < k; ++t) {
      const int64_t c = j - t + pad;
      if (c < 0 || c >= C) continue;
      const int64_t g = c / d;
      gp += double(kq[t]) * dqk[g] * key[c] +
            double(kk[t]) * (dqk[g] * q[c] + dkn[g] * key[c]);
    }
    grad_pooled[b * C + j] = T(gp);
  }
  double* out = partial + b * (2 * k + G * G);
  for (int64_t t = 0; t < k; ++t) {  // sum over j of dq[j - t + pad] p[j]
    double sq = 0, sk = 0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const int64_t j = c + t - pad;
      if (j < 0 || j >= C) continue;
      const int64_t g = c / d;
      sq += dqk[g] * key[c] * double(p[j]);
      sk += (dqk[g] * q[c] + dkn[g] * key[c]) * double(p[j]);
    }
    sq = block_sum(sq, red);
    sk = block_sum(sk, red);
    if (threadIdx.x == 0) {
      out[t] = sq;
      out[k + t] = sk;
    }
  }
  for (int64_t i = threadIdx.x; i < G * G; i += blockDim.x)
    out[2 * k + i] = da[i / G] * rel[i % G];
}

// grad_q_kernel, grad_k_kernel (k,) and grad_gate_weight (G * G,) as the
// sums of `partial` (B, 2k + G * G) over the batch, in sample order.
template <typename T>
__global__ void kcla_heads_reduce_cuda_kernel(
    const int64_t B, const int64_t k, const int64_t GG,
    const double* __restrict__ partial, T* __restrict__ grad_q_kernel,
    T* __restrict__ grad_k_kernel, T* __restrict__ grad_gate_w) {
  const int64_t width = 2 * k + GG;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < width;
       i += (int64_t)blockDim.x * gridDim.x) {
    double sum = 0;
    for (int64_t b = 0; b < B; ++b) sum += partial[b * width + i];
    if (i < k)
      grad_q_kernel[i] = T(sum);
    else if (i < 2 * k)
      grad_k_kernel[i - k] = T(sum);
    else
      grad_gate_w[i - 2 * k] = T(sum);
  }
}
#endif  // KCLA_HEADS_CUDA_KERNEL_CUH
