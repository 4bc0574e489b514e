// What kcla_mm's CUDA kernels and launchers share: the grid-stride loop,
// the default block size, a block-wide sum, and the launchers' grid and
// shared-memory sizing.
#ifndef KCLA_CUDA_HELPER_CUH
#define KCLA_CUDA_HELPER_CUH
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#define KCLA_CUDA_1D_KERNEL_LOOP(i, n)                              \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; \
       i < (n); i += (int64_t)blockDim.x * gridDim.x)

constexpr int KCLA_THREADS = 256;  // a power of two (block_sum)

// The sum of every thread's `v` over the block; `red` holds blockDim.x
// doubles. Called by all threads.
__device__ inline double block_sum(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  const double sum = red[0];
  __syncthreads();
  return sum;
}

// Blocks of KCLA_THREADS for a grid-stride loop over n items.
inline int kcla_grid(int64_t n) {
  return int(std::max<int64_t>(
      1, std::min<int64_t>((n + KCLA_THREADS - 1) / KCLA_THREADS, 4096)));
}

// Dynamic shared memory of `doubles` doubles per block, within the default
// 48 KiB.
inline size_t kcla_shared_bytes(int64_t doubles, const char* op) {
  const size_t bytes = size_t(doubles) * sizeof(double);
  TORCH_CHECK(bytes <= 48 * 1024, op, ": ", doubles, " doubles per sample "
              "exceed a CUDA block's 48 KiB of shared memory");
  return bytes;
}
#endif  // KCLA_CUDA_HELPER_CUH
