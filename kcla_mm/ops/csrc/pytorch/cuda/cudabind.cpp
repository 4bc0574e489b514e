// Registers the CUDA launchers (compiled only in CUDAExtension builds).
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
