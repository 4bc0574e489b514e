// Registers the CUDA launchers (compiled only in CUDAExtension builds).
// Each launcher is declared with the type of the *_impl it implements, so
// the signatures are written once, in the common headers.
#include "kcla_adapter_impl.hpp"
#include "kcla_branch_impl.hpp"
#include "kcla_state_impl.hpp"
#include "pytorch_device_registry.hpp"

// pytorch/cuda/kcla_state_cuda.cu
decltype(kcla_state_forward_impl) kcla_state_forward_cuda;
decltype(kcla_state_backward_impl) kcla_state_backward_cuda;
decltype(kcla_state_growth_impl) kcla_state_growth_cuda;
// pytorch/cuda/kcla_branch_cuda.cu
decltype(kcla_relu_pool_forward_impl) kcla_relu_pool_forward_cuda;
decltype(kcla_relu_pool_backward_impl) kcla_relu_pool_backward_cuda;
decltype(kcla_branch_stats_impl) kcla_branch_stats_cuda;
decltype(kcla_branch_forward_impl) kcla_branch_forward_cuda;
decltype(kcla_branch_apply_impl) kcla_branch_apply_cuda;
decltype(kcla_branch_bn_sums_impl) kcla_branch_bn_sums_cuda;
decltype(kcla_branch_backward_impl) kcla_branch_backward_cuda;
// pytorch/cuda/kcla_branch_train_cuda.cu
decltype(kcla_branch_train_forward_impl) kcla_branch_train_forward_cuda;
decltype(kcla_branch_train_backward_impl) kcla_branch_train_backward_cuda;
// pytorch/cuda/kcla_heads_cuda.cu
decltype(kcla_heads_forward_impl) kcla_heads_forward_cuda;
decltype(kcla_heads_backward_impl) kcla_heads_backward_cuda;
// pytorch/cuda/kcla_layer_cuda.cu
decltype(kcla_layer_inference_impl) kcla_layer_inference_cuda;
decltype(kcla_adapter_inference_impl) kcla_adapter_inference_cuda;
// pytorch/cuda/kcla_adapter_cuda.cu
decltype(kcla_adapter_heads_forward_impl) kcla_adapter_heads_forward_cuda;
decltype(kcla_adapter_heads_backward_impl) kcla_adapter_heads_backward_cuda;

REGISTER_DEVICE_IMPL(kcla_state_forward_impl, CUDA, kcla_state_forward_cuda);
REGISTER_DEVICE_IMPL(kcla_state_backward_impl, CUDA, kcla_state_backward_cuda);
REGISTER_DEVICE_IMPL(kcla_state_growth_impl, CUDA, kcla_state_growth_cuda);
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
REGISTER_DEVICE_IMPL(kcla_heads_forward_impl, CUDA, kcla_heads_forward_cuda);
REGISTER_DEVICE_IMPL(kcla_heads_backward_impl, CUDA,
                     kcla_heads_backward_cuda);
REGISTER_DEVICE_IMPL(kcla_adapter_heads_forward_impl, CUDA,
                     kcla_adapter_heads_forward_cuda);
REGISTER_DEVICE_IMPL(kcla_adapter_heads_backward_impl, CUDA,
                     kcla_adapter_heads_backward_cuda);
REGISTER_DEVICE_IMPL(kcla_branch_train_forward_impl, CUDA,
                     kcla_branch_train_forward_cuda);
REGISTER_DEVICE_IMPL(kcla_branch_train_backward_impl, CUDA,
                     kcla_branch_train_backward_cuda);
REGISTER_DEVICE_IMPL(kcla_layer_inference_impl, CUDA,
                     kcla_layer_inference_cuda);
REGISTER_DEVICE_IMPL(kcla_adapter_inference_impl, CUDA,
                     kcla_adapter_inference_cuda);
