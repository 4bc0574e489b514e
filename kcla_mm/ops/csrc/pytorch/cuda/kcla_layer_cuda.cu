// CUDA launchers of the one-call inference ops (common/kcla_branch_impl.hpp):
// a whole KCLA layer as the BN folds, relu_pool with the block's tail BN,
// the heads and the branch (four kernels, no ATen op between them); the
// cross-stage adapter as the strided state's GAP, the adapter's per-head
// scalars (kcla_adapter_cuda.cu) and one batched matmul.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kcla_adapter_impl.hpp"
#include "kcla_branch_cuda_kernel.cuh"
#include "kcla_branch_impl.hpp"
#include "pytorch_cpp_helper.hpp"

// pytorch/cuda/kcla_heads_cuda.cu, kcla_branch_cuda.cu, kcla_adapter_cuda.cu
decltype(kcla_heads_forward_impl) kcla_heads_forward_cuda;
decltype(kcla_branch_forward_impl) kcla_branch_forward_cuda;
decltype(kcla_adapter_heads_forward_impl) kcla_adapter_heads_forward_cuda;
// kcla_relu_pool_forward_cuda with the block's folded tail BN (tail_scale,
// tail_shift: (C,) or undefined), pytorch/cuda/kcla_branch_cuda.cu
void kcla_relu_pool_tail_forward_cuda(at::Tensor s, const at::Tensor residual,
                                      at::Tensor mask, at::Tensor pooled,
                                      const at::Tensor tail_scale,
                                      const at::Tensor tail_shift);

void kcla_layer_inference_cuda(at::Tensor s,
                               const LayerInferenceOperands& a) {
  const int64_t B = s.size(0), C = s.size(1);
  if (B * C == 0) return;
  at::cuda::CUDAGuard device_guard(s.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // rows: the branch BN's scale and shift, then the tail BN's
  at::Tensor folded = at::empty({4, C}, s.options());
  at::Tensor pooled = at::empty({B, C}, s.options());
  const bool tail = a.tail_weight.defined();
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "kcla_layer_inference_cuda",
                             [&] {
    using T = scalar_t;
    kcla_fold_bn_cuda_kernel<T><<<kcla_grid(C), KCLA_THREADS, 0, stream>>>(
        C, a.bn_weight.data_ptr<T>(), a.bn_bias.data_ptr<T>(),
        a.bn_mean.data_ptr<T>(), a.bn_var.data_ptr<T>(), a.bn_eps,
        data_ptr_or_null<T>(a.tail_weight), data_ptr_or_null<T>(a.tail_bias),
        data_ptr_or_null<T>(a.tail_mean), data_ptr_or_null<T>(a.tail_var),
        a.tail_eps, folded.data_ptr<T>());
  });
  AT_CUDA_CHECK(cudaGetLastError());
  kcla_relu_pool_tail_forward_cuda(s, a.residual, at::Tensor(), pooled,
                                   tail ? folded[2] : at::Tensor(),
                                   tail ? folded[3] : at::Tensor());
  kcla_heads_forward_cuda(pooled, a.z, a.q_kernel, a.k_kernel, a.norm_d,
                          a.gate_weight, a.w, a.z_next, a.gate, a.key_eps,
                          a.max_log_weight);
  kcla_branch_forward_cuda(s, a.u, a.w, a.z_next, a.gate, a.weight,
                           folded[0], folded[1], at::Tensor(), a.u_next, s,
                           at::Tensor(), a.eps);
}

void kcla_adapter_inference_cuda(
    const at::Tensor u, const at::Tensor z, const at::Tensor weight,
    int64_t stride, const at::Tensor bn_weight, const at::Tensor bn_bias,
    const at::Tensor bn_mean, const at::Tensor bn_var,
    const at::Tensor k_kernel, const at::Tensor norm_d, at::Tensor u_out,
    at::Tensor z_out, double bn_eps, double max_log_weight) {
  const int64_t B = u.size(0), G = z_out.size(1), ci = u.size(1) / G;
  const int64_t co = u_out.size(1) / G, hw = u_out.size(2) * u_out.size(3);
  at::cuda::CUDAGuard device_guard(u.device());
  // U at the stride, as the strided 1x1 conv reads it
  const at::Tensor us =
      u.slice(2, 0, c10::nullopt, stride).slice(3, 0, c10::nullopt, stride)
          .reshape({B * G, ci, hw});
  const auto opt = u.options();
  const AdapterHeads a{us.mean(-1).view({B, G, ci}), at::Tensor(), z,
                       weight.reshape({G, co, ci}), bn_weight, bn_bias,
                       bn_mean, bn_var, k_kernel, norm_d, hw,
                       /*batch_stats=*/false, -1.0, bn_eps, max_log_weight};
  const AdapterHeadsOut out{at::empty({B, G, co, ci}, opt),
                            at::empty({B, G, co}, opt), z_out,
                            at::empty({3, B, G, co}, opt),
                            at::empty({2, G, co}, opt)};
  kcla_adapter_heads_forward_cuda(a.um, a, out);
  at::Tensor u3 = u_out.view({B * G, co, hw});
  at::baddbmm_out(u3, out.bias.view({B * G, co, 1}),
                  out.mat.view({B * G, co, ci}), us);
}
