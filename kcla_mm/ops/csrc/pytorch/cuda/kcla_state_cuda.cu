// CUDA launchers of the KCLA state op.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "kcla_state_cuda_kernel.cuh"
#include "kcla_state_impl.hpp"
#include "pytorch_cpp_helper.hpp"

void kcla_state_forward_cuda(const at::Tensor x, const at::Tensor u,
                             const at::Tensor w, const at::Tensor z,
                             at::Tensor u_next, at::Tensor agg, double eps) {
  const int64_t total = x.numel();
  if (total == 0) return;
  const int64_t length = total / w.numel();
  at::cuda::CUDAGuard device_guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t blocks = std::min<int64_t>(
      (total + KCLA_THREADS - 1) / KCLA_THREADS, 65535LL * 8);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, x.scalar_type(),
      "kcla_state_forward_cuda", [&] {
        kcla_state_forward_cuda_kernel<scalar_t>
            <<<blocks, KCLA_THREADS, 0, stream>>>(
                total, length, x.data_ptr<scalar_t>(),
                data_ptr_or_null<scalar_t>(u), w.data_ptr<scalar_t>(),
                z.data_ptr<scalar_t>(), u_next.data_ptr<scalar_t>(),
                agg.data_ptr<scalar_t>(), static_cast<float>(eps));
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_state_backward_cuda(const at::Tensor grad_u_next,
                              const at::Tensor grad_agg, const at::Tensor x,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor agg, at::Tensor grad_x,
                              at::Tensor grad_u, at::Tensor grad_w,
                              at::Tensor grad_z, double eps) {
  const int64_t chunks = w.numel();
  if (chunks == 0) return;
  const int64_t length = x.numel() / chunks;
  at::cuda::CUDAGuard device_guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, x.scalar_type(),
      "kcla_state_backward_cuda", [&] {
        kcla_state_backward_cuda_kernel<scalar_t>
            <<<chunks, KCLA_THREADS, 0, stream>>>(
                length, grad_u_next.data_ptr<scalar_t>(),
                grad_agg.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                w.data_ptr<scalar_t>(), z.data_ptr<scalar_t>(),
                agg.data_ptr<scalar_t>(), grad_x.data_ptr<scalar_t>(),
                data_ptr_or_null<scalar_t>(grad_u),
                grad_w.data_ptr<scalar_t>(), grad_z.data_ptr<scalar_t>(),
                static_cast<float>(eps));
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_state_growth_cuda(const at::Tensor z, const at::Tensor floor,
                            at::Tensor floor_out, at::Tensor flag,
                            double limit) {
  at::cuda::CUDAGuard device_guard(z.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "kcla_state_growth_cuda", [&] {
    kcla_state_growth_cuda_kernel<scalar_t><<<1, KCLA_THREADS, 0, stream>>>(
        z.numel(), z.data_ptr<scalar_t>(), floor.data_ptr<scalar_t>(),
        floor_out.data_ptr<scalar_t>(), flag.data_ptr<bool>(),
        static_cast<scalar_t>(limit));
  });
  AT_CUDA_CHECK(cudaGetLastError());
}
