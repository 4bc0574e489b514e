// CUDA launchers of the adapter's per-head scalars in training
// (kcla_adapter_cuda_kernel.cuh).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "kcla_adapter_cuda_kernel.cuh"
#include "kcla_adapter_impl.hpp"
#include "pytorch_cpp_helper.hpp"

namespace {

template <typename T>
AdapterArgs<T> adapter_args(const AdapterHeads& a) {
  AdapterArgs<T> r;
  r.B = a.um.size(0), r.G = a.um.size(1), r.ci = a.um.size(2);
  r.co = a.weight.defined() ? a.weight.size(1) : r.ci;
  r.C = r.G * r.co, r.Gi = a.z_in.size(1), r.din = r.G * r.ci / r.Gi;
  r.k = a.k_kernel.numel(), r.pad = (r.k - 1) / 2, r.hw = a.hw;
  r.bs = a.batch_stats, r.momentum = a.momentum, r.bn_eps = a.bn_eps;
  r.max_log = a.max_log;
  r.um = a.um.data_ptr<T>(), r.cov = data_ptr_or_null<T>(a.cov);
  r.z_in = a.z_in.data_ptr<T>(), r.weight = data_ptr_or_null<T>(a.weight);
  r.gamma = a.bn_weight.data_ptr<T>(), r.beta = a.bn_bias.data_ptr<T>();
  r.kk = a.k_kernel.data_ptr<T>(), r.norm_d = a.norm_d.data_ptr<T>();
  r.rm = data_ptr_or_null<T>(a.running_mean);
  r.rv = data_ptr_or_null<T>(a.running_var);
  return r;
}

}  // namespace

void kcla_adapter_heads_forward_cuda(const at::Tensor um,
                                     const AdapterHeads& a,
                                     const AdapterHeadsOut& out) {
  at::cuda::CUDAGuard device_guard(um.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t B = um.size(0), C = out.bias.size(1) * out.bias.size(2);
  const auto dopt = um.options().dtype(at::kDouble);
  at::Tensor y = at::empty({B, C}, dopt);
  at::Tensor v = a.batch_stats ? at::empty({B, C}, dopt) : y;
  const size_t smem = kcla_shared_bytes(2 * C + out.z_out.size(1),
                                   "kcla_adapter_heads_forward_cuda");
  AT_DISPATCH_FLOATING_TYPES(
      um.scalar_type(), "kcla_adapter_heads_forward_cuda", [&] {
        const auto args = adapter_args<scalar_t>(a);
        scalar_t* mean = out.bn_stats[0].data_ptr<scalar_t>();
        scalar_t* invstd = out.bn_stats[1].data_ptr<scalar_t>();
        adapter_moments_kernel<scalar_t>
            <<<kcla_grid(B * C), KCLA_THREADS, 0, stream>>>(
                args, y.data_ptr<double>(), v.data_ptr<double>());
        AT_CUDA_CHECK(cudaGetLastError());
        adapter_bn_kernel<scalar_t>
            <<<kcla_grid(C), KCLA_THREADS, 0, stream>>>(
                args, y.data_ptr<double>(), v.data_ptr<double>(), mean,
                invstd);
        AT_CUDA_CHECK(cudaGetLastError());
        adapter_heads_kernel<scalar_t>
            <<<B, KCLA_THREADS, smem, stream>>>(
                args, y.data_ptr<double>(), mean, invstd,
                out.mat.data_ptr<scalar_t>(), out.bias.data_ptr<scalar_t>(),
                out.z_out.data_ptr<scalar_t>(), out.aux.data_ptr<scalar_t>());
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_adapter_heads_backward_cuda(const at::Tensor um,
                                      const AdapterHeads& a,
                                      const AdapterHeadsOut& saved,
                                      const AdapterHeadsGrads& g) {
  at::cuda::CUDAGuard device_guard(um.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t B = um.size(0), G = um.size(1), ci = um.size(2);
  const int64_t C = saved.aux.size(2) * saved.aux.size(3);
  const int64_t k = a.k_kernel.numel();
  const auto dopt = um.options().dtype(at::kDouble);
  at::Tensor partials = at::empty({4, B, C}, dopt);
  at::Tensor gkk = at::empty({B, k}, dopt);
  at::Tensor gv = at::empty({C}, dopt);
  at::Tensor gzc = at::empty({B, G * ci}, dopt);
  const size_t smem =
      kcla_shared_bytes(2 * C + 2 * G + KCLA_THREADS,
                   "kcla_adapter_heads_backward_cuda");
  AT_DISPATCH_FLOATING_TYPES(
      um.scalar_type(), "kcla_adapter_heads_backward_cuda", [&] {
        using T = scalar_t;
        const auto args = adapter_args<T>(a);
        double* p = partials.data_ptr<double>();
        const AdapterGradArgs<T> r{
            g.grad_mat.data_ptr<T>(), g.grad_bias.data_ptr<T>(),
            data_ptr_or_null<T>(g.grad_z), saved.aux.data_ptr<T>(),
            saved.bn_stats[0].data_ptr<T>(), saved.bn_stats[1].data_ptr<T>(),
            saved.z_out.data_ptr<T>(), p, p + B * C, p + 2 * B * C,
            p + 3 * B * C, gkk.data_ptr<double>(), gv.data_ptr<double>(),
            gzc.data_ptr<double>()};
        adapter_grad_heads_kernel<T>
            <<<B, KCLA_THREADS, smem, stream>>>(args, r);
        AT_CUDA_CHECK(cudaGetLastError());
        adapter_grad_bn_kernel<T>
            <<<kcla_grid(std::max(C, k)), KCLA_THREADS, 0, stream>>>(
                args, r, g.grad_bn_weight.data_ptr<T>(),
                g.grad_bn_bias.data_ptr<T>(), g.grad_k_kernel.data_ptr<T>());
        AT_CUDA_CHECK(cudaGetLastError());
        adapter_grad_state_kernel<T>
            <<<B * G, KCLA_THREADS, 0, stream>>>(
                args, r, g.r.data_ptr<T>(), data_ptr_or_null<T>(g.s));
        AT_CUDA_CHECK(cudaGetLastError());
        adapter_grad_params_kernel<T>
            <<<kcla_grid(std::max(C * ci, B * a.z_in.size(1))),
               KCLA_THREADS, 0, stream>>>(
                args, r, data_ptr_or_null<T>(g.grad_weight),
                g.grad_z_in.data_ptr<T>());
      });
  AT_CUDA_CHECK(cudaGetLastError());
}
