// CUDA launchers of the KCLA heads (kcla_heads_cuda_kernel.cuh).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "kcla_branch_impl.hpp"
#include "kcla_heads_cuda_kernel.cuh"
#include "pytorch_cpp_helper.hpp"

namespace {

HeadDims head_dims(const at::Tensor& pooled, const at::Tensor& q_kernel,
                   const at::Tensor& w, double key_eps,
                   double max_log_weight) {
  const int64_t C = pooled.size(1), G = w.size(1), k = q_kernel.numel();
  return {C, G, C / G, k, (k - 1) / 2, key_eps, max_log_weight};
}

}  // namespace

void kcla_heads_forward_cuda(const at::Tensor pooled, const at::Tensor z,
                             const at::Tensor q_kernel,
                             const at::Tensor k_kernel,
                             const at::Tensor norm_d,
                             const at::Tensor gate_weight, at::Tensor w,
                             at::Tensor z_next, at::Tensor gate,
                             double key_eps, double max_log_weight) {
  const int64_t B = pooled.size(0);
  if (B == 0) return;
  const HeadDims hd = head_dims(pooled, q_kernel, w, key_eps, max_log_weight);
  const size_t smem =
      kcla_shared_bytes(2 * hd.C + hd.G, "kcla_heads_forward_cuda");
  at::cuda::CUDAGuard device_guard(pooled.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(
      pooled.scalar_type(), "kcla_heads_forward_cuda", [&] {
        kcla_heads_forward_cuda_kernel<scalar_t>
            <<<B, KCLA_THREADS, smem, stream>>>(
                hd, pooled.data_ptr<scalar_t>(),
                data_ptr_or_null<scalar_t>(z), q_kernel.data_ptr<scalar_t>(),
                k_kernel.data_ptr<scalar_t>(), norm_d.data_ptr<scalar_t>(),
                gate_weight.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                z_next.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>());
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_heads_backward_cuda(
    const at::Tensor pooled, const at::Tensor q_kernel,
    const at::Tensor k_kernel, const at::Tensor norm_d,
    const at::Tensor gate_weight, const at::Tensor w, const at::Tensor gate,
    const at::Tensor grad_w, const at::Tensor grad_gate,
    at::Tensor grad_pooled, at::Tensor grad_q_kernel,
    at::Tensor grad_k_kernel, at::Tensor grad_gate_weight, double key_eps,
    double max_log_weight) {
  const int64_t B = pooled.size(0);
  const HeadDims hd = head_dims(pooled, q_kernel, w, key_eps, max_log_weight);
  if (B == 0) {
    grad_q_kernel.zero_();
    grad_k_kernel.zero_();
    grad_gate_weight.zero_();
    return;
  }
  const size_t smem = kcla_shared_bytes(2 * hd.C + 4 * hd.G + KCLA_THREADS,
                                        "kcla_heads_backward_cuda");
  const int64_t width = 2 * hd.k + hd.G * hd.G;
  at::Tensor partial =
      at::empty({B, width}, pooled.options().dtype(at::kDouble));
  at::cuda::CUDAGuard device_guard(pooled.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(
      pooled.scalar_type(), "kcla_heads_backward_cuda", [&] {
        kcla_heads_backward_cuda_kernel<scalar_t>
            <<<B, KCLA_THREADS, smem, stream>>>(
                hd, pooled.data_ptr<scalar_t>(),
                q_kernel.data_ptr<scalar_t>(), k_kernel.data_ptr<scalar_t>(),
                norm_d.data_ptr<scalar_t>(), gate_weight.data_ptr<scalar_t>(),
                w.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(),
                grad_w.data_ptr<scalar_t>(), grad_gate.data_ptr<scalar_t>(),
                grad_pooled.data_ptr<scalar_t>(),
                partial.data_ptr<double>());
        AT_CUDA_CHECK(cudaGetLastError());
        kcla_heads_reduce_cuda_kernel<scalar_t>
            <<<kcla_grid(width), KCLA_THREADS, 0, stream>>>(
                B, hd.k, hd.G * hd.G, partial.data_ptr<double>(),
                grad_q_kernel.data_ptr<scalar_t>(),
                grad_k_kernel.data_ptr<scalar_t>(),
                grad_gate_weight.data_ptr<scalar_t>());
      });
  AT_CUDA_CHECK(cudaGetLastError());
}
