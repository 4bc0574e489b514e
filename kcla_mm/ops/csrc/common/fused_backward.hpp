// What the fused ops' C++ autograd Functions cannot do, as errors that
// name the way out (kcla_mm/ops/fused_backward.py's messages, handed over
// by set_fused_backward_errors when the extension is loaded): their
// backwards are first order only and take one gradient at a time.
#ifndef KCLA_FUSED_BACKWARD_HPP
#define KCLA_FUSED_BACKWARD_HPP
#include <ATen/LegacyBatchedTensorImpl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <string>

inline std::string second_order_error = "second derivative not implemented";
inline std::string batched_grad_error = "batched gradients not implemented";

inline void set_fused_backward_errors(const std::string& second_order,
                                      const std::string& batched_grads) {
  second_order_error = second_order;
  batched_grad_error = batched_grads;
}

// Whether `t` is a vmap BatchedTensor (legacy, as is_grads_batched makes,
// or functorch's; the two headers' isBatchedTensor cannot both be
// included), which has no storage for the kernels.
inline bool batched(const at::Tensor& t) {
  if (!t.defined()) return false;
  const auto keys = t.unsafeGetTensorImpl()->key_set();
  return at::isBatchedTensor(t) ||
         keys.has(c10::DispatchKey::FuncTorchBatched)
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 2  // torch 2.2's key
         || keys.has(c10::DispatchKey::BatchedNestedTensor)
#endif
      ;
}

// Identity on a backward's gradients, raising when differentiated.
struct SecondOrderBarrier : torch::autograd::Function<SecondOrderBarrier> {
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext*, at::TensorList grads) {
    torch::autograd::variable_list out;
    for (const auto& g : grads) out.push_back(g.view_as(g));
    return out;
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    TORCH_CHECK(false, second_order_error);
    return {};
  }
};

// torch.autograd.function.once_differentiable with the errors above:
// `backward` runs without grad on unbatched gradients; under
// create_graph=True its gradients lead to a SecondOrderBarrier.
template <typename Backward>
torch::autograd::variable_list first_order_backward(
    const torch::autograd::variable_list& grads, Backward&& backward) {
  bool needs_barrier = false;
  for (const auto& g : grads) {
    TORCH_CHECK(!batched(g), batched_grad_error);
    needs_barrier |= g.defined() && g.requires_grad();
  }
  torch::autograd::variable_list outputs;
  {
    at::NoGradGuard no_grad;
    outputs = backward();
  }
  if (!needs_barrier || !at::GradMode::is_enabled()) return outputs;
  torch::autograd::variable_list leaves;
  for (const auto& o : outputs)
    if (o.defined()) leaves.push_back(o.detach().requires_grad_());
  if (leaves.empty()) return outputs;
  torch::autograd::variable_list guarded =
      SecondOrderBarrier::apply(at::TensorList(leaves));
  size_t next = 0;
  for (auto& o : outputs)
    if (o.defined()) o = guarded[next++];
  return outputs;
}
#endif  // KCLA_FUSED_BACKWARD_HPP
