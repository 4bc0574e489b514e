// CUDA kernels of the fused KCLA branch (see common/kcla_branch_impl.hpp;
// the CPU kernels, pytorch/cpu/kcla_branch_kernels.hpp, are the reference
// for every formula and its grouping).
//
// One thread block per (b, c) plane, in a grid-stride loop over the planes
// (every thread of a block walks the same planes, so __syncthreads() inside
// the loop is uniform). A first pass computes per-element values and writes
// the plane that the 3x3 stencil reads (u_next to global memory, or the
// gradient of the conv output to a workspace), __syncthreads(), then the
// stencil pass reads neighbours. Sums over a plane are accumulated in
// at::opmath_type<scalar_t> and written per plane by thread 0; nothing is
// reduced across planes.
//
// Aliasing (as on the CPU): u_next may alias u, out may alias x, u_prev may
// alias u_next. Such pointers carry no __restrict__, and every element of
// them is read and then written by one thread at one position, or all
// neighbour reads of a plane are fenced off from its writes by a barrier.
#ifndef KCLA_BRANCH_CUDA_KERNEL_CUH
#define KCLA_BRANCH_CUDA_KERNEL_CUH
#include <ATen/OpMathType.h>

#include <cstdint>

#include "kcla_cuda_helper.cuh"

// Largest block size (the launchers use 64, 128 or 256, multiples of 32:
// the mask writers use whole-warp ballots).
constexpr int KCLA_BRANCH_THREADS = 256;
constexpr int KCLA_BRANCH_MAX_WARPS = KCLA_BRANCH_THREADS / 32;

// The geometry of the (B, C, H, W) maps: G heads of d = C / G channels,
// bit masks of `bytes` = ceil(H * W / 8) bytes per plane.
struct KclaBranchDims {
  int64_t C, G, d, H, W, HW, bytes;
};

// Index into the (B, G) tensors of plane p = b * C + c.
__device__ __forceinline__ int64_t kcla_branch_head(const KclaBranchDims& dm,
                                                    int64_t p) {
  return (p / dm.C) * dm.G + (p % dm.C) / dm.d;
}

// Bit i % 8 of byte i / 8: position i of a plane's mask.
__device__ __forceinline__ bool kcla_mask_bit(const uint8_t* bits,
                                              int64_t i) {
  return (bits[i >> 3] >> (i & 7)) & 1;
}

// std::max(v, 0) as the CPU computes it ((v < 0) ? 0 : v; NaN stays NaN).
template <typename acc_t>
__device__ __forceinline__ acc_t kcla_relu(acc_t v) {
  return v < acc_t(0) ? acc_t(0) : v;
}

// The warp's positions base .. base + 31 (base a multiple of 32) carry the
// decisions `on` (false past the plane's end); lanes 0-3 write the four
// bytes of those positions, each byte whole (bit k of byte j = position
// 8 j + k), so no two threads write one byte. All 32 lanes must call this.
__device__ __forceinline__ void kcla_store_mask_bits(uint8_t* bits,
                                                     int64_t base, int lane,
                                                     bool on,
                                                     int64_t bytes) {
  const unsigned ballot = __ballot_sync(0xffffffffu, on);
  const int64_t j = base / 8 + lane;
  if (lane < 4 && j < bytes) {
    bits[j] = static_cast<uint8_t>((ballot >> (8 * lane)) & 0xffu);
  }
}

// Sums each v[k] over the block; the results are valid in thread 0. smem
// holds N * KCLA_BRANCH_MAX_WARPS values. Ends with a barrier, so smem (and
// whatever the block read before the call) may be reused right after.
template <typename acc_t, int N>
__device__ __forceinline__ void kcla_block_sum(acc_t (&v)[N], acc_t* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
#pragma unroll
  for (int k = 0; k < N; ++k) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      v[k] += __shfl_down_sync(0xffffffffu, v[k], offset);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) smem[k * KCLA_BRANCH_MAX_WARPS + warp] = v[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      acc_t s = lane < warps ? smem[k * KCLA_BRANCH_MAX_WARPS + lane]
                             : acc_t(0);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        s += __shfl_down_sync(0xffffffffu, s, offset);
      }
      v[k] = s;
    }
  }
  __syncthreads();
}

// a[3 k + l] = un(r + k - 1, col + l - 1) * inv, 0 outside the plane: the
// zero-padded 3x3 input window of the depthwise conv at (r, col).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void kcla_load_window(const scalar_t* un,
                                                 const KclaBranchDims& dm,
                                                 int64_t r, int64_t col,
                                                 acc_t inv, acc_t (&a)[9]) {
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const int64_t rr = r + k - 1;
    const bool row_in = rr >= 0 && rr < dm.H;
#pragma unroll
    for (int l = 0; l < 3; ++l) {
      const int64_t cc = col + l - 1;
      a[3 * k + l] = (row_in && cc >= 0 && cc < dm.W)
                         ? static_cast<acc_t>(un[rr * dm.W + cc]) * inv
                         : acc_t(0);
    }
  }
}

// sum_t k9[t] * a[t] in the CPU's tap order (cross-correlation, F.conv2d).
template <typename acc_t>
__device__ __forceinline__ acc_t kcla_conv9(const acc_t (&k9)[9],
                                            const acc_t (&a)[9]) {
  acc_t s = acc_t(0);
#pragma unroll
  for (int t = 0; t < 9; ++t) s += k9[t] * a[t];
  return s;
}

// DWConv3x3(un * inv) at position i of the plane.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t kcla_conv_at(const scalar_t* un,
                                              const KclaBranchDims& dm,
                                              int64_t i, acc_t inv,
                                              const acc_t (&k9)[9]) {
  const int64_t r = i / dm.W;
  acc_t a[9];
  kcla_load_window<scalar_t, acc_t>(un, dm, r, i - r * dm.W, inv, a);
  return kcla_conv9<acc_t>(k9, a);
}

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void kcla_load_kernel9(const scalar_t* weight,
                                                  int64_t c, acc_t (&k9)[9]) {
#pragma unroll
  for (int t = 0; t < 9; ++t) k9[t] = static_cast<acc_t>(weight[c * 9 + t]);
}

// u_next = u + w x over plane p (u may be null or alias u_next), then a
// barrier: the stencil that follows reads neighbours' u_next.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void kcla_update_plane(const scalar_t* x,
                                                  const scalar_t* u,
                                                  scalar_t* u_next,
                                                  int64_t off, int64_t hw,
                                                  acc_t wv) {
  for (int64_t i = threadIdx.x; i < hw; i += blockDim.x) {
    acc_t s = wv * static_cast<acc_t>(x[off + i]);
    if (u != nullptr) s += static_cast<acc_t>(u[off + i]);
    u_next[off + i] = static_cast<scalar_t>(s);
  }
  __syncthreads();
}

// s = ReLU(tail_scale * s + tail_shift + residual) in place (the block's
// folded tail BN, per channel of C, and the residual optional); mask
// (optional) = [s > 0]; pooled = plane mean.
template <typename scalar_t>
__global__ void kcla_relu_pool_forward_cuda_kernel(
    const int64_t planes, const int64_t hw, const int64_t bytes, scalar_t* s,
    const scalar_t* __restrict__ residual, uint8_t* __restrict__ mask,
    scalar_t* __restrict__ pooled, const int64_t C,
    const scalar_t* __restrict__ tail_scale,
    const scalar_t* __restrict__ tail_shift) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t red[KCLA_BRANCH_MAX_WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  for (int64_t p = blockIdx.x; p < planes; p += gridDim.x) {
    scalar_t* v = s + p * hw;
    const bool affine = tail_scale != nullptr;
    const acc_t sc = affine ? static_cast<acc_t>(tail_scale[p % C]) : 1;
    const acc_t sh = affine ? static_cast<acc_t>(tail_shift[p % C]) : 0;
    acc_t sum[1] = {acc_t(0)};
    for (int64_t base = int64_t(warp) * 32; base < hw;
         base += int64_t(warps) * 32) {
      const int64_t i = base + lane;
      bool on = false;
      if (i < hw) {
        acc_t r = static_cast<acc_t>(v[i]);
        if (affine) r = r * sc + sh;
        if (residual != nullptr) r += static_cast<acc_t>(residual[p * hw + i]);
        r = kcla_relu(r);
        v[i] = static_cast<scalar_t>(r);
        sum[0] += r;
        on = r > acc_t(0);
      }
      if (mask != nullptr) {
        kcla_store_mask_bits(mask + p * bytes, base, lane, on, bytes);
      }
    }
    kcla_block_sum<acc_t, 1>(sum, red);
    if (threadIdx.x == 0) {
      pooled[p] = static_cast<scalar_t>(sum[0] / static_cast<acc_t>(hw));
    }
  }
}

// An eval BN as an affine per channel, scale = weight / sqrt(var + eps)
// and shift = bias - mean * scale (as the CPU kernels fold it), for the
// branch BN (rows 0, 1 of folded, (4, C)) and, where tail_weight is given,
// the block's tail BN (rows 2, 3).
template <typename scalar_t>
__global__ void kcla_fold_bn_cuda_kernel(
    const int64_t C, const scalar_t* __restrict__ weight,
    const scalar_t* __restrict__ bias, const scalar_t* __restrict__ mean,
    const scalar_t* __restrict__ var, const double eps,
    const scalar_t* __restrict__ tail_weight,
    const scalar_t* __restrict__ tail_bias,
    const scalar_t* __restrict__ tail_mean,
    const scalar_t* __restrict__ tail_var, const double tail_eps,
    scalar_t* __restrict__ folded) {
  KCLA_CUDA_1D_KERNEL_LOOP(c, C) {
    scalar_t sc = weight[c] * (scalar_t(1) / sqrt(var[c] + scalar_t(eps)));
    folded[c] = sc;
    folded[C + c] = bias[c] - mean[c] * sc;
    if (tail_weight != nullptr) {
      sc = tail_weight[c] *
           (scalar_t(1) / sqrt(tail_var[c] + scalar_t(tail_eps)));
      folded[2 * C + c] = sc;
      folded[3 * C + c] = tail_bias[c] - tail_mean[c] * sc;
    }
  }
}

// grad_s = mask ? grad_x + grad_pooled / (H W) : 0, element-wise.
template <typename scalar_t>
__global__ void kcla_relu_pool_backward_cuda_kernel(
    const int64_t total, const int64_t hw, const int64_t bytes,
    const scalar_t* __restrict__ grad_x,
    const scalar_t* __restrict__ grad_pooled,
    const uint8_t* __restrict__ mask, scalar_t* __restrict__ grad_s) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)blockDim.x * gridDim.x) {
    const int64_t p = i / hw, k = i - p * hw;
    if (kcla_mask_bit(mask + p * bytes, k)) {
      const acc_t gp =
          static_cast<acc_t>(grad_pooled[p]) / static_cast<acc_t>(hw);
      grad_s[i] = static_cast<scalar_t>(static_cast<acc_t>(grad_x[i]) + gp);
    } else {
      grad_s[i] = static_cast<scalar_t>(0);
    }
  }
}

// u_next = u + w x and stats[p] = (mean, sum of squared deviations) of
// o = gate * DWConv3x3(u_next / (z + eps)) over the plane, two-phase.
template <typename scalar_t>
__global__ void kcla_branch_stats_cuda_kernel(
    const int64_t planes, const KclaBranchDims dm, const scalar_t* x,
    const scalar_t* u, const scalar_t* __restrict__ w,
    const scalar_t* __restrict__ z, const scalar_t* __restrict__ gate,
    const scalar_t* __restrict__ weight, scalar_t* u_next,
    scalar_t* __restrict__ stats, const double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t red[KCLA_BRANCH_MAX_WARPS];
  __shared__ acc_t plane_mean;
  for (int64_t p = blockIdx.x; p < planes; p += gridDim.x) {
    const int64_t c = p % dm.C, n = kcla_branch_head(dm, p);
    const int64_t off = p * dm.HW;
    const acc_t inv =
        acc_t(1) / (static_cast<acc_t>(z[n]) + static_cast<acc_t>(eps));
    const acc_t gt = static_cast<acc_t>(gate[n]);
    acc_t k9[9];
    kcla_load_kernel9<scalar_t, acc_t>(weight, c, k9);
    kcla_update_plane<scalar_t, acc_t>(x, u, u_next, off, dm.HW,
                                       static_cast<acc_t>(w[n]));
    const scalar_t* un = u_next + off;
    acc_t sum[1] = {acc_t(0)};
    for (int64_t i = threadIdx.x; i < dm.HW; i += blockDim.x) {
      sum[0] += gt * kcla_conv_at<scalar_t, acc_t>(un, dm, i, inv, k9);
    }
    kcla_block_sum<acc_t, 1>(sum, red);
    if (threadIdx.x == 0) plane_mean = sum[0] / static_cast<acc_t>(dm.HW);
    __syncthreads();
    const acc_t mu = plane_mean;
    acc_t m2[1] = {acc_t(0)};
    for (int64_t i = threadIdx.x; i < dm.HW; i += blockDim.x) {
      const acc_t dev =
          gt * kcla_conv_at<scalar_t, acc_t>(un, dm, i, inv, k9) - mu;
      m2[0] += dev * dev;
    }
    // (its barriers also keep plane_mean until every thread has read it)
    kcla_block_sum<acc_t, 1>(m2, red);
    if (threadIdx.x == 0) {
      stats[2 * p] = static_cast<scalar_t>(mu);
      stats[2 * p + 1] = static_cast<scalar_t>(m2[0]);
    }
  }
}

// Update = true (kcla_branch_forward): u_next = u + w x first; false
// (kcla_branch_apply): u_next is an input. Then out = x + keep *
// ReLU(scale * o + shift), mask (optional) = [scale * o + shift > 0];
// keep null = 1. out may alias x, u_next may alias u.
template <typename scalar_t, bool Update>
__global__ void kcla_branch_forward_cuda_kernel(
    const int64_t planes, const KclaBranchDims dm, const scalar_t* x,
    const scalar_t* u, const scalar_t* __restrict__ w,
    const scalar_t* __restrict__ z, const scalar_t* __restrict__ gate,
    const scalar_t* __restrict__ weight, const scalar_t* __restrict__ scale,
    const scalar_t* __restrict__ shift, const scalar_t* __restrict__ keep,
    scalar_t* u_next, scalar_t* out, uint8_t* __restrict__ mask,
    const double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  for (int64_t p = blockIdx.x; p < planes; p += gridDim.x) {
    const int64_t c = p % dm.C, n = kcla_branch_head(dm, p);
    const int64_t off = p * dm.HW;
    const acc_t inv =
        acc_t(1) / (static_cast<acc_t>(z[n]) + static_cast<acc_t>(eps));
    // y = (scale * gate) * DWConv(agg) + shift, grouped as the CPU does
    const acc_t scg =
        static_cast<acc_t>(scale[c]) * static_cast<acc_t>(gate[n]);
    const acc_t sh = static_cast<acc_t>(shift[c]);
    const acc_t kp =
        keep != nullptr ? static_cast<acc_t>(keep[p / dm.C]) : acc_t(1);
    acc_t k9[9];
    kcla_load_kernel9<scalar_t, acc_t>(weight, c, k9);
    if (Update) {
      kcla_update_plane<scalar_t, acc_t>(x, u, u_next, off, dm.HW,
                                         static_cast<acc_t>(w[n]));
    }
    const scalar_t* un = u_next + off;
    // the stencil reads only u_next; x and out are touched at position i
    // only, by the thread that owns i, so out may overwrite x
    for (int64_t base = int64_t(warp) * 32; base < dm.HW;
         base += int64_t(warps) * 32) {
      const int64_t i = base + lane;
      bool on = false;
      if (i < dm.HW) {
        const acc_t y =
            scg * kcla_conv_at<scalar_t, acc_t>(un, dm, i, inv, k9) + sh;
        out[off + i] = static_cast<scalar_t>(
            static_cast<acc_t>(x[off + i]) + kp * kcla_relu(y));
        on = y > acc_t(0);
      }
      if (mask != nullptr) {
        kcla_store_mask_bits(mask + p * dm.bytes, base, lane, on, dm.bytes);
      }
    }
  }
}

// bn_sums[p] = (sum g, sum g * (o - mean[c])), g = grad_out * keep * mask.
template <typename scalar_t>
__global__ void kcla_branch_bn_sums_cuda_kernel(
    const int64_t planes, const KclaBranchDims dm,
    const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ u_next,
    const scalar_t* __restrict__ z, const scalar_t* __restrict__ gate,
    const scalar_t* __restrict__ weight, const scalar_t* __restrict__ keep,
    const uint8_t* __restrict__ mask, const scalar_t* __restrict__ mean,
    scalar_t* __restrict__ bn_sums, const double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t red[2 * KCLA_BRANCH_MAX_WARPS];
  for (int64_t p = blockIdx.x; p < planes; p += gridDim.x) {
    const int64_t c = p % dm.C, n = kcla_branch_head(dm, p);
    const int64_t off = p * dm.HW;
    const acc_t inv =
        acc_t(1) / (static_cast<acc_t>(z[n]) + static_cast<acc_t>(eps));
    const acc_t gt = static_cast<acc_t>(gate[n]);
    const acc_t kp = static_cast<acc_t>(keep[p / dm.C]);
    const acc_t mu = static_cast<acc_t>(mean[c]);
    acc_t k9[9];
    kcla_load_kernel9<scalar_t, acc_t>(weight, c, k9);
    const scalar_t* un = u_next + off;
    const uint8_t* bits = mask + p * dm.bytes;
    acc_t sums[2] = {acc_t(0), acc_t(0)};
    for (int64_t i = threadIdx.x; i < dm.HW; i += blockDim.x) {
      const acc_t o = gt * kcla_conv_at<scalar_t, acc_t>(un, dm, i, inv, k9);
      const acc_t gn = kcla_mask_bit(bits, i)
                           ? static_cast<acc_t>(grad_out[off + i]) * kp
                           : acc_t(0);
      sums[0] += gn;
      sums[1] += gn * (o - mu);
    }
    kcla_block_sum<acc_t, 2>(sums, red);
    if (threadIdx.x == 0) {
      bn_sums[2 * p] = static_cast<scalar_t>(sums[0]);
      bn_sums[2 * p + 1] = static_cast<scalar_t>(sums[1]);
    }
  }
}

// Slots of the backward's per-plane sums.
constexpr int KCLA_BWD_SG = 0;       // sum g
constexpr int KCLA_BWD_SGC = 1;      // sum g (o - mean)
constexpr int KCLA_BWD_GATE = 2;     // d/dgate
constexpr int KCLA_BWD_WEIGHT = 3;   // 9 taps of d/dweight: 3 .. 11
constexpr int KCLA_BWD_W = 12;       // d/dw
constexpr int KCLA_BWD_Z = 13;       // sum g_agg u_next (d/dz = -it inv^2)
constexpr int KCLA_BWD_SUMS = 14;

// Gradients of the branch (kcla_branch_backward_impl). Phase A, per
// position: o = gate * DWConv(agg) with agg = u_next * inv, x = out - y
// with y = keep * (scale o + shift) where the mask is set (else 0), the
// gradient reaching o, g_o = scale g + alpha + beta (o - mean), and the
// conv output's gradient g_conv = g_o * gate, written with x to the
// workspace (2 H W values: dynamic shared memory when `work` is null,
// else `work` + blockIdx.x * 2 H W in global memory); d/dweight needs only
// g_conv at the position and the input window already loaded. Barrier.
// Phase B: g_agg = the transposed conv of g_conv (kernel flipped), the
// state's gradients, grad_x and u_prev = u_next - w x. Every neighbour read
// of u_next is in phase A and u_prev (which may alias u_next) is written in
// phase B, each position by the thread that read it there.
template <typename scalar_t>
__global__ void kcla_branch_backward_cuda_kernel(
    const int64_t planes, const KclaBranchDims dm,
    const scalar_t* __restrict__ grad_out,
    const scalar_t* __restrict__ grad_u_next,
    const scalar_t* __restrict__ out, const scalar_t* u_next,
    const scalar_t* __restrict__ w, const scalar_t* __restrict__ z,
    const scalar_t* __restrict__ gate, const scalar_t* __restrict__ weight,
    const scalar_t* __restrict__ scale, const scalar_t* __restrict__ shift,
    const scalar_t* __restrict__ keep, const uint8_t* __restrict__ mask,
    const scalar_t* __restrict__ alpha, const scalar_t* __restrict__ beta,
    const scalar_t* __restrict__ mean, scalar_t* __restrict__ grad_x,
    scalar_t* __restrict__ grad_u, scalar_t* u_prev,
    scalar_t* __restrict__ bn_sums, scalar_t* __restrict__ head_sums,
    scalar_t* __restrict__ weight_sums, at::opmath_type<scalar_t>* work,
    const double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(sizeof(double)) unsigned char kcla_branch_smem[];
  __shared__ acc_t red[KCLA_BWD_SUMS * KCLA_BRANCH_MAX_WARPS];
  acc_t* g_conv = work != nullptr
                      ? work + int64_t(blockIdx.x) * 2 * dm.HW
                      : reinterpret_cast<acc_t*>(kcla_branch_smem);
  acc_t* x_rec = g_conv + dm.HW;
  for (int64_t p = blockIdx.x; p < planes; p += gridDim.x) {
    const int64_t c = p % dm.C, n = kcla_branch_head(dm, p);
    const int64_t off = p * dm.HW;
    const acc_t wv = static_cast<acc_t>(w[n]);
    const acc_t gt = static_cast<acc_t>(gate[n]);
    const acc_t inv =
        acc_t(1) / (static_cast<acc_t>(z[n]) + static_cast<acc_t>(eps));
    const acc_t sc = static_cast<acc_t>(scale[c]);
    const acc_t sh = static_cast<acc_t>(shift[c]);
    const acc_t kp = static_cast<acc_t>(keep[p / dm.C]);
    const acc_t al = static_cast<acc_t>(alpha[c]);
    const acc_t be = static_cast<acc_t>(beta[c]);
    const acc_t mu = static_cast<acc_t>(mean[c]);
    acc_t k9[9];
    kcla_load_kernel9<scalar_t, acc_t>(weight, c, k9);
    const scalar_t* un = u_next + off;
    const uint8_t* bits = mask + p * dm.bytes;
    acc_t sums[KCLA_BWD_SUMS];
#pragma unroll
    for (int k = 0; k < KCLA_BWD_SUMS; ++k) sums[k] = acc_t(0);

    // phase A
    for (int64_t i = threadIdx.x; i < dm.HW; i += blockDim.x) {
      const int64_t r = i / dm.W, col = i - r * dm.W;
      acc_t a[9];
      kcla_load_window<scalar_t, acc_t>(un, dm, r, col, inv, a);
      const acc_t cv = kcla_conv9<acc_t>(k9, a);  // before the gate
      const bool on = kcla_mask_bit(bits, i);
      const acc_t o = gt * cv;
      const acc_t y = on ? kp * (sc * o + sh) : acc_t(0);
      x_rec[i] = static_cast<acc_t>(out[off + i]) - y;
      const acc_t gn =
          on ? static_cast<acc_t>(grad_out[off + i]) * kp : acc_t(0);
      sums[KCLA_BWD_SG] += gn;
      sums[KCLA_BWD_SGC] += gn * (o - mu);
      const acc_t g_o = sc * gn + al + be * (o - mu);
      sums[KCLA_BWD_GATE] += g_o * cv;
      const acc_t gc = g_o * gt;
      g_conv[i] = gc;
#pragma unroll
      for (int t = 0; t < 9; ++t) sums[KCLA_BWD_WEIGHT + t] += gc * a[t];
    }
    __syncthreads();  // g_conv complete; all neighbour reads of u_next done

    // phase B
    for (int64_t i = threadIdx.x; i < dm.HW; i += blockDim.x) {
      const int64_t r = i / dm.W, col = i - r * dm.W;
      // transposed conv: the flipped kernel over g_conv's window, in the
      // CPU's tap order
      acc_t g_agg = acc_t(0);
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const int64_t rr = r + k - 1;
        const bool row_in = rr >= 0 && rr < dm.H;
#pragma unroll
        for (int l = 0; l < 3; ++l) {
          const int64_t cc = col + l - 1;
          const acc_t gv = (row_in && cc >= 0 && cc < dm.W)
                               ? g_conv[rr * dm.W + cc]
                               : acc_t(0);
          g_agg += k9[8 - (3 * k + l)] * gv;
        }
      }
      const acc_t unv = static_cast<acc_t>(un[i]);
      const acc_t xr = x_rec[i];
      const acc_t g_total =
          (grad_u_next != nullptr ? static_cast<acc_t>(grad_u_next[off + i])
                                  : acc_t(0)) +
          g_agg * inv;
      if (grad_u != nullptr) grad_u[off + i] = static_cast<scalar_t>(g_total);
      grad_x[off + i] = static_cast<scalar_t>(
          static_cast<acc_t>(grad_out[off + i]) + g_total * wv);
      sums[KCLA_BWD_W] += g_total * xr;
      sums[KCLA_BWD_Z] += g_agg * unv;
      if (u_prev != nullptr) {
        u_prev[off + i] = static_cast<scalar_t>(unv - wv * xr);
      }
    }
    // (its barriers also end this plane's reads of the workspace before
    // the next plane's phase A overwrites it)
    kcla_block_sum<acc_t, KCLA_BWD_SUMS>(sums, red);
    if (threadIdx.x == 0) {
      bn_sums[2 * p] = static_cast<scalar_t>(sums[KCLA_BWD_SG]);
      bn_sums[2 * p + 1] = static_cast<scalar_t>(sums[KCLA_BWD_SGC]);
      head_sums[3 * p] = static_cast<scalar_t>(sums[KCLA_BWD_W]);
      head_sums[3 * p + 1] =
          static_cast<scalar_t>(-sums[KCLA_BWD_Z] * inv * inv);
      head_sums[3 * p + 2] = static_cast<scalar_t>(sums[KCLA_BWD_GATE]);
#pragma unroll
      for (int t = 0; t < 9; ++t) {
        weight_sums[9 * p + t] =
            static_cast<scalar_t>(sums[KCLA_BWD_WEIGHT + t]);
      }
    }
  }
}

#endif  // KCLA_BRANCH_CUDA_KERNEL_CUH
