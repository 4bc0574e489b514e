// Registers the CUDA launchers (compiled only in CUDAExtension builds).
#include "kcla_branch_impl.hpp"
#include "kcla_state_impl.hpp"
#include "pytorch_device_registry.hpp"

void kcla_state_forward_cuda(const at::Tensor x, const at::Tensor u,
                             const at::Tensor w, const at::Tensor z,
                             at::Tensor u_next, at::Tensor agg, double eps);
void kcla_state_backward_cuda(const at::Tensor grad_u_next,
                              const at::Tensor grad_agg, const at::Tensor x,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor agg, at::Tensor grad_x,
                              at::Tensor grad_u, at::Tensor grad_w,
                              at::Tensor grad_z, double eps);

REGISTER_DEVICE_IMPL(kcla_state_forward_impl, CUDA, kcla_state_forward_cuda);
REGISTER_DEVICE_IMPL(kcla_state_backward_impl, CUDA, kcla_state_backward_cuda);

void kcla_relu_pool_forward_cuda(at::Tensor s, at::Tensor mask,
                                 at::Tensor pooled);
void kcla_relu_pool_backward_cuda(const at::Tensor grad_x,
                                  const at::Tensor grad_pooled,
                                  const at::Tensor mask, at::Tensor grad_s);
void kcla_branch_stats_cuda(const at::Tensor x, const at::Tensor u,
                            const at::Tensor w, const at::Tensor z,
                            const at::Tensor gate, const at::Tensor weight,
                            at::Tensor u_next, at::Tensor stats, double eps);
void kcla_branch_forward_cuda(const at::Tensor x, const at::Tensor u,
                              const at::Tensor w, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              const at::Tensor scale, const at::Tensor shift,
                              const at::Tensor keep, at::Tensor u_next,
                              at::Tensor out, at::Tensor mask, double eps);
void kcla_branch_apply_cuda(const at::Tensor x, const at::Tensor u_next,
                            const at::Tensor z, const at::Tensor gate,
                            const at::Tensor weight, const at::Tensor scale,
                            const at::Tensor shift, const at::Tensor keep,
                            at::Tensor out, at::Tensor mask, double eps);
void kcla_branch_bn_sums_cuda(const at::Tensor grad_out,
                              const at::Tensor u_next, const at::Tensor z,
                              const at::Tensor gate, const at::Tensor weight,
                              const at::Tensor keep, const at::Tensor mask,
                              const at::Tensor mean, at::Tensor bn_sums,
                              double eps);
void kcla_branch_backward_cuda(
    const at::Tensor grad_out, const at::Tensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, at::Tensor grad_x, at::Tensor grad_u,
    at::Tensor u_prev, at::Tensor bn_sums, at::Tensor head_sums,
    at::Tensor weight_sums, double eps);

REGISTER_DEVICE_IMPL(kcla_relu_pool_forward_impl, CUDA,
                     kcla_relu_pool_forward_cuda);
REGISTER_DEVICE_IMPL(kcla_relu_pool_backward_impl, CUDA,
                     kcla_relu_pool_backward_cuda);
REGISTER_DEVICE_IMPL(kcla_branch_stats_impl, CUDA, kcla_branch_stats_cuda);
REGISTER_DEVICE_IMPL(kcla_branch_forward_impl, CUDA, kcla_branch_forward_cuda);
REGISTER_DEVICE_IMPL(kcla_branch_apply_impl, CUDA, kcla_branch_apply_cuda);
REGISTER_DEVICE_IMPL(kcla_branch_bn_sums_impl, CUDA, kcla_branch_bn_sums_cuda);
REGISTER_DEVICE_IMPL(kcla_branch_backward_impl, CUDA,
                     kcla_branch_backward_cuda);
