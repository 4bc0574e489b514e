// CUDA kernels of the KCLA state op (see common/kcla_state_impl.hpp).
#ifndef KCLA_STATE_CUDA_KERNEL_CUH
#define KCLA_STATE_CUDA_KERNEL_CUH
#include <ATen/OpMathType.h>

#include "kcla_cuda_helper.cuh"

// Element-wise: u_next = u + w * x, agg = u_next / (z + eps).
template <typename scalar_t>
__global__ void kcla_state_forward_cuda_kernel(
    const int64_t total, const int64_t length, const scalar_t* __restrict__ x,
    const scalar_t* __restrict__ u, const scalar_t* __restrict__ w,
    const scalar_t* __restrict__ z, scalar_t* __restrict__ u_next,
    scalar_t* __restrict__ agg, const float eps) {
  using acc_t = at::opmath_type<scalar_t>;
  KCLA_CUDA_1D_KERNEL_LOOP(i, total) {
    const int64_t n = i / length;
    acc_t s = static_cast<acc_t>(w[n]) * static_cast<acc_t>(x[i]);
    if (u != nullptr) s += static_cast<acc_t>(u[i]);
    u_next[i] = static_cast<scalar_t>(s);
    agg[i] = static_cast<scalar_t>(s / (static_cast<acc_t>(z[n]) + acc_t(eps)));
  }
}

// One block per chunk (b, g): element-wise input gradients, then a block
// reduction for grad_w and grad_z.
template <typename scalar_t>
__global__ void kcla_state_backward_cuda_kernel(
    const int64_t length, const scalar_t* __restrict__ grad_u_next,
    const scalar_t* __restrict__ grad_agg, const scalar_t* __restrict__ x,
    const scalar_t* __restrict__ w, const scalar_t* __restrict__ z,
    const scalar_t* __restrict__ agg, scalar_t* __restrict__ grad_x,
    scalar_t* __restrict__ grad_u, scalar_t* __restrict__ grad_w,
    scalar_t* __restrict__ grad_z, const float eps) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t shared_gx[KCLA_THREADS];
  __shared__ acc_t shared_ga[KCLA_THREADS];
  const int64_t n = blockIdx.x;
  const acc_t wn = static_cast<acc_t>(w[n]);
  const acc_t inv = acc_t(1) / (static_cast<acc_t>(z[n]) + acc_t(eps));
  acc_t sum_gx = 0, sum_ga = 0;
  for (int64_t i = n * length + threadIdx.x; i < (n + 1) * length;
       i += blockDim.x) {
    const acc_t ga = static_cast<acc_t>(grad_agg[i]);
    const acc_t g = static_cast<acc_t>(grad_u_next[i]) + ga * inv;
    if (grad_u != nullptr) grad_u[i] = static_cast<scalar_t>(g);
    grad_x[i] = static_cast<scalar_t>(g * wn);
    sum_gx += g * static_cast<acc_t>(x[i]);
    sum_ga += ga * static_cast<acc_t>(agg[i]);
  }
  shared_gx[threadIdx.x] = sum_gx;
  shared_ga[threadIdx.x] = sum_ga;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      shared_gx[threadIdx.x] += shared_gx[threadIdx.x + stride];
      shared_ga[threadIdx.x] += shared_ga[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    grad_w[n] = static_cast<scalar_t>(shared_gx[0]);
    grad_z[n] = static_cast<scalar_t>(-shared_ga[0] * inv);
  }
}

// One block: flag = any(z > limit * floor), floor_out = flag ? z : floor.
template <typename scalar_t>
__global__ void kcla_state_growth_cuda_kernel(
    const int64_t n, const scalar_t* __restrict__ z,
    const scalar_t* __restrict__ floor, scalar_t* __restrict__ floor_out,
    bool* __restrict__ flag, const scalar_t limit) {
  int grew = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    grew |= z[i] > limit * floor[i];
  grew = __syncthreads_or(grew);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    floor_out[i] = grew ? z[i] : floor[i];
  if (threadIdx.x == 0) *flag = grew != 0;
}

#endif  // KCLA_STATE_CUDA_KERNEL_CUH
