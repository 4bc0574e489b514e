// CUDA launchers of the one-call training branch: the per-pass branch
// kernels (kcla_branch_cuda.cu) with the per-channel glue between them
// (kcla_branch_train_cuda_kernel.cuh) instead of ATen ops.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "kcla_branch_impl.hpp"
#include "kcla_branch_train_cuda_kernel.cuh"
#include "pytorch_cpp_helper.hpp"

// pytorch/cuda/kcla_branch_cuda.cu
decltype(kcla_branch_stats_impl) kcla_branch_stats_cuda;
decltype(kcla_branch_apply_impl) kcla_branch_apply_cuda;
decltype(kcla_branch_bn_sums_impl) kcla_branch_bn_sums_cuda;
decltype(kcla_branch_backward_impl) kcla_branch_backward_cuda;

void kcla_branch_train_forward_cuda(
    const at::Tensor x, const at::Tensor u, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor bn_weight, const at::Tensor bn_bias,
    at::Tensor running_mean, at::Tensor running_var, const at::Tensor keep,
    at::Tensor u_next, at::Tensor out, at::Tensor mask, at::Tensor mean,
    at::Tensor invstd, at::Tensor scale, at::Tensor shift, double momentum,
    double bn_eps, double eps) {
  const int64_t B = x.size(0), C = x.size(1), hw = x.size(2) * x.size(3);
  at::cuda::CUDAGuard device_guard(x.device());
  at::Tensor stats = at::empty({B, C, 2}, x.options());
  kcla_branch_stats_cuda(x, u, w, z, gate, weight, u_next, stats, eps);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(
      x.scalar_type(), "kcla_branch_train_forward_cuda", [&] {
        branch_fold_stats_kernel<scalar_t>
            <<<kcla_grid(C), KCLA_THREADS, 0, stream>>>(
                B, C, hw, stats.data_ptr<scalar_t>(),
                bn_weight.data_ptr<scalar_t>(), bn_bias.data_ptr<scalar_t>(),
                data_ptr_or_null<scalar_t>(running_mean),
                data_ptr_or_null<scalar_t>(running_var), momentum, bn_eps,
                mean.data_ptr<scalar_t>(), invstd.data_ptr<scalar_t>(),
                scale.data_ptr<scalar_t>(), shift.data_ptr<scalar_t>());
      });
  AT_CUDA_CHECK(cudaGetLastError());
  kcla_branch_apply_cuda(x, u_next, z, gate, weight, scale, shift, keep, out,
                         mask, eps);
}

void kcla_branch_train_backward_cuda(
    const at::Tensor grad_out, const at::Tensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor mean, const at::Tensor invstd,
    at::Tensor grad_x, at::Tensor grad_u, at::Tensor u_prev,
    at::Tensor grad_w, at::Tensor grad_z, at::Tensor grad_gate,
    at::Tensor grad_weight, at::Tensor grad_bn_weight,
    at::Tensor grad_bn_bias, bool batch_stats, double eps) {
  const int64_t B = out.size(0), C = out.size(1), G = w.size(1);
  const int64_t n = B * out.size(2) * out.size(3);
  at::cuda::CUDAGuard device_guard(out.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto options = out.options();
  at::Tensor bn_sums, alpha = at::empty({C}, options);
  at::Tensor beta = at::empty({C}, options);
  at::Tensor sums = at::empty({2, C}, options.dtype(at::kDouble));
  if (batch_stats) {  // the batch statistics depend on o
    bn_sums = at::empty({B, C, 2}, options);
    kcla_branch_bn_sums_cuda(grad_out, u_next, z, gate, weight, keep, mask,
                             mean, bn_sums, eps);
  }
  AT_DISPATCH_FLOATING_TYPES(
      out.scalar_type(), "kcla_branch_bn_terms_cuda", [&] {
        branch_bn_terms_kernel<scalar_t><<<kcla_grid(C), KCLA_THREADS, 0, stream>>>(
            B, C, n, data_ptr_or_null<scalar_t>(bn_sums),
            scale.data_ptr<scalar_t>(), invstd.data_ptr<scalar_t>(),
            alpha.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(),
            sums.data_ptr<double>());
      });
  AT_CUDA_CHECK(cudaGetLastError());
  at::Tensor plane_bn_sums = at::empty({B, C, 2}, options);
  at::Tensor head_sums = at::empty({B, C, 3}, options);
  at::Tensor weight_sums = at::empty({B, C, 9}, options);
  kcla_branch_backward_cuda(grad_out, grad_u_next, out, u_next, w, z, gate,
                            weight, scale, shift, keep, mask, alpha, beta,
                            mean, grad_x, grad_u, u_prev, plane_bn_sums,
                            head_sums, weight_sums, eps);
  AT_DISPATCH_FLOATING_TYPES(
      out.scalar_type(), "kcla_branch_grad_sums_cuda", [&] {
        branch_grad_sums_kernel<scalar_t>
            <<<kcla_grid(C + B * G), KCLA_THREADS, 0, stream>>>(
                B, C, G, batch_stats, sums.data_ptr<double>(),
                plane_bn_sums.data_ptr<scalar_t>(),
                invstd.data_ptr<scalar_t>(), head_sums.data_ptr<scalar_t>(),
                weight_sums.data_ptr<scalar_t>(), grad_w.data_ptr<scalar_t>(),
                grad_z.data_ptr<scalar_t>(), grad_gate.data_ptr<scalar_t>(),
                grad_weight.data_ptr<scalar_t>(),
                grad_bn_weight.data_ptr<scalar_t>(),
                grad_bn_bias.data_ptr<scalar_t>());
      });
  AT_CUDA_CHECK(cudaGetLastError());
}
