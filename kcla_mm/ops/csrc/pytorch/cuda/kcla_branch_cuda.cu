// CUDA launchers of the fused KCLA branch (see common/kcla_branch_impl.hpp;
// the kernels are in common/cuda/kcla_branch_cuda_kernel.cuh). Arguments
// are checked by the op entries (pytorch/kcla_branch.cpp); optional tensors
// arrive undefined and are passed to the kernels as null pointers.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "kcla_branch_cuda_kernel.cuh"
#include "kcla_branch_impl.hpp"
#include "pytorch_cpp_helper.hpp"

namespace {

// The geometry of the (B, C, H, W) map `x` with `groups` heads.
KclaBranchDims branch_dims(const at::Tensor& x, int64_t groups) {
  KclaBranchDims dm;
  dm.C = x.size(1);
  dm.G = groups;
  dm.d = x.size(1) / groups;
  dm.H = x.size(2);
  dm.W = x.size(3);
  dm.HW = x.size(2) * x.size(3);
  dm.bytes = (dm.HW + 7) / 8;
  return dm;
}

// Block size for planes of hw elements: a multiple of 32, at most
// KCLA_BRANCH_THREADS, without many idle warps on small planes.
int plane_threads(int64_t hw) {
  return hw <= 64 ? 64 : hw <= 128 ? 128 : KCLA_BRANCH_THREADS;
}

// One block per plane; the kernels loop over planes when capped.
int64_t plane_grid(int64_t planes) {
  return std::min<int64_t>(planes, int64_t(1) << 24);
}

// The backward keeps its 2 H W workspace values in dynamic shared memory
// up to this size (below the 48 KiB a block may use without opting in,
// leaving room for the static reduction buffer), else in global memory.
constexpr size_t kMaxDynamicSmem = 40 * 1024;
// Cap of the global workspace: fewer blocks (each looping over planes)
// beyond it.
constexpr int64_t kMaxWorkspaceBytes = int64_t(256) << 20;

}  // namespace

void kcla_relu_pool_tail_forward_cuda(at::Tensor s, const at::Tensor residual,
                                      at::Tensor mask, at::Tensor pooled,
                                      const at::Tensor tail_scale,
                                      const at::Tensor tail_shift) {
  const int64_t planes = s.size(0) * s.size(1);
  if (planes == 0) return;
  const int64_t hw = s.size(2) * s.size(3), bytes = (hw + 7) / 8;
  at::cuda::CUDAGuard device_guard(s.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, s.scalar_type(),
      "kcla_relu_pool_forward_cuda", [&] {
        kcla_relu_pool_forward_cuda_kernel<scalar_t>
            <<<plane_grid(planes), plane_threads(hw), 0, stream>>>(
                planes, hw, bytes, s.data_ptr<scalar_t>(),
                data_ptr_or_null<scalar_t>(residual),
                data_ptr_or_null<uint8_t>(mask),
                pooled.data_ptr<scalar_t>(), s.size(1),
                data_ptr_or_null<scalar_t>(tail_scale),
                data_ptr_or_null<scalar_t>(tail_shift));
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_relu_pool_forward_cuda(at::Tensor s, const at::Tensor residual,
                                 at::Tensor mask, at::Tensor pooled) {
  kcla_relu_pool_tail_forward_cuda(s, residual, mask, pooled, at::Tensor(),
                                   at::Tensor());
}

void kcla_relu_pool_backward_cuda(const at::Tensor grad_x,
                                  const at::Tensor grad_pooled,
                                  const at::Tensor mask, at::Tensor grad_s) {
  const int64_t total = grad_x.numel();
  if (total == 0) return;
  const int64_t hw = grad_x.size(2) * grad_x.size(3), bytes = (hw + 7) / 8;
  at::cuda::CUDAGuard device_guard(grad_x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t blocks = std::min<int64_t>(
      (total + KCLA_BRANCH_THREADS - 1) / KCLA_BRANCH_THREADS, 65535LL * 8);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, grad_x.scalar_type(),
      "kcla_relu_pool_backward_cuda", [&] {
        kcla_relu_pool_backward_cuda_kernel<scalar_t>
            <<<blocks, KCLA_BRANCH_THREADS, 0, stream>>>(
                total, hw, bytes, grad_x.data_ptr<scalar_t>(),
                grad_pooled.data_ptr<scalar_t>(), mask.data_ptr<uint8_t>(),
                grad_s.data_ptr<scalar_t>());
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_branch_stats_cuda(const at::Tensor x, const at::Tensor u,
                            const at::Tensor w, const at::Tensor z,
                            const at::Tensor gate, const at::Tensor weight,
                            at::Tensor u_next, at::Tensor stats, double eps) {
  const int64_t planes = x.size(0) * x.size(1);
  if (planes == 0) return;
  const KclaBranchDims dm = branch_dims(x, w.size(1));
  at::cuda::CUDAGuard device_guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, x.scalar_type(),
      "kcla_branch_stats_cuda", [&] {
        kcla_branch_stats_cuda_kernel<scalar_t>
            <<<plane_grid(planes), plane_threads(dm.HW), 0, stream>>>(
                planes, dm, x.data_ptr<scalar_t>(),
                data_ptr_or_null<scalar_t>(u), w.data_ptr<scalar_t>(),
                z.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(),
                weight.data_ptr<scalar_t>(), u_next.data_ptr<scalar_t>(),
                stats.data_ptr<scalar_t>(), eps);
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_branch_forward_cuda(const at::Tensor x, const at::Tensor u,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              const at::Tensor scale, const at::Tensor shift,
                              const at::Tensor keep, at::Tensor u_next,
                              at::Tensor out, at::Tensor mask, double eps) {
  const int64_t planes = x.size(0) * x.size(1);
  if (planes == 0) return;
  const KclaBranchDims dm = branch_dims(x, z.size(1));
  at::cuda::CUDAGuard device_guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, x.scalar_type(),
      "kcla_branch_forward_cuda", [&] {
        kcla_branch_forward_cuda_kernel<scalar_t, true>
            <<<plane_grid(planes), plane_threads(dm.HW), 0, stream>>>(
                planes, dm, x.data_ptr<scalar_t>(),
                data_ptr_or_null<scalar_t>(u), w.data_ptr<scalar_t>(),
                z.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(),
                weight.data_ptr<scalar_t>(), scale.data_ptr<scalar_t>(),
                shift.data_ptr<scalar_t>(), data_ptr_or_null<scalar_t>(keep),
                u_next.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                data_ptr_or_null<uint8_t>(mask), eps);
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_branch_apply_cuda(const at::Tensor x, const at::Tensor u_next,
                            const at::Tensor z, const at::Tensor gate,
                            const at::Tensor weight, const at::Tensor scale,
                            const at::Tensor shift, const at::Tensor keep,
                            at::Tensor out, at::Tensor mask, double eps) {
  const int64_t planes = x.size(0) * x.size(1);
  if (planes == 0) return;
  const KclaBranchDims dm = branch_dims(x, z.size(1));
  at::cuda::CUDAGuard device_guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, x.scalar_type(),
      "kcla_branch_apply_cuda", [&] {
        // Update = false: u_next is only read, u and w are unused
        kcla_branch_forward_cuda_kernel<scalar_t, false>
            <<<plane_grid(planes), plane_threads(dm.HW), 0, stream>>>(
                planes, dm, x.data_ptr<scalar_t>(), nullptr, nullptr,
                z.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(),
                weight.data_ptr<scalar_t>(), scale.data_ptr<scalar_t>(),
                shift.data_ptr<scalar_t>(), data_ptr_or_null<scalar_t>(keep),
                u_next.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                data_ptr_or_null<uint8_t>(mask), eps);
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_branch_bn_sums_cuda(const at::Tensor grad_out,
                              const at::Tensor u_next, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              const at::Tensor keep, const at::Tensor mask,
                              const at::Tensor mean, at::Tensor bn_sums,
                              double eps) {
  const int64_t planes = u_next.size(0) * u_next.size(1);
  if (planes == 0) return;
  const KclaBranchDims dm = branch_dims(u_next, z.size(1));
  at::cuda::CUDAGuard device_guard(u_next.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, u_next.scalar_type(),
      "kcla_branch_bn_sums_cuda", [&] {
        kcla_branch_bn_sums_cuda_kernel<scalar_t>
            <<<plane_grid(planes), plane_threads(dm.HW), 0, stream>>>(
                planes, dm, grad_out.data_ptr<scalar_t>(),
                u_next.data_ptr<scalar_t>(), z.data_ptr<scalar_t>(),
                gate.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                keep.data_ptr<scalar_t>(), mask.data_ptr<uint8_t>(),
                mean.data_ptr<scalar_t>(), bn_sums.data_ptr<scalar_t>(), eps);
      });
  AT_CUDA_CHECK(cudaGetLastError());
}

void kcla_branch_backward_cuda(
    const at::Tensor grad_out, const at::Tensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, at::Tensor grad_x, at::Tensor grad_u,
    at::Tensor u_prev, at::Tensor bn_sums, at::Tensor head_sums,
    at::Tensor weight_sums, double eps) {
  const int64_t planes = out.size(0) * out.size(1);
  if (planes == 0) return;
  const KclaBranchDims dm = branch_dims(out, w.size(1));
  at::cuda::CUDAGuard device_guard(out.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int threads = plane_threads(dm.HW);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, out.scalar_type(),
      "kcla_branch_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        // per block: g_conv and the recovered x, one plane each
        const int64_t block_values = 2 * dm.HW;
        const size_t block_bytes = size_t(block_values) * sizeof(acc_t);
        int64_t grid = plane_grid(planes);
        size_t smem = block_bytes;
        at::Tensor work;  // global workspace when a plane is too large
        if (block_bytes > kMaxDynamicSmem) {
          const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
          const int64_t resident =
              int64_t(prop->multiProcessorCount) *
              std::max(1, prop->maxThreadsPerMultiProcessor / threads);
          grid = std::min<int64_t>(
              grid, std::min<int64_t>(
                        resident, std::max<int64_t>(
                                      1, kMaxWorkspaceBytes /
                                             int64_t(block_bytes))));
          work = at::empty(
              {grid * block_values},
              out.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
          smem = 0;
        }
        kcla_branch_backward_cuda_kernel<scalar_t>
            <<<grid, threads, smem, stream>>>(
                planes, dm, grad_out.data_ptr<scalar_t>(),
                data_ptr_or_null<scalar_t>(grad_u_next),
                out.data_ptr<scalar_t>(), u_next.data_ptr<scalar_t>(),
                w.data_ptr<scalar_t>(), z.data_ptr<scalar_t>(),
                gate.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                scale.data_ptr<scalar_t>(), shift.data_ptr<scalar_t>(),
                keep.data_ptr<scalar_t>(), mask.data_ptr<uint8_t>(),
                alpha.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(),
                mean.data_ptr<scalar_t>(), grad_x.data_ptr<scalar_t>(),
                data_ptr_or_null<scalar_t>(grad_u),
                data_ptr_or_null<scalar_t>(u_prev),
                bn_sums.data_ptr<scalar_t>(), head_sums.data_ptr<scalar_t>(),
                weight_sums.data_ptr<scalar_t>(),
                work.defined() ? work.data_ptr<acc_t>() : nullptr, eps);
      });
  AT_CUDA_CHECK(cudaGetLastError());
}
