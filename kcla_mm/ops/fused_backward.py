"""What the fused ops' backwards cannot do, as errors that name the way
out: they are first order only (a gradient taken with
``create_graph=True`` cannot be differentiated again through them) and
take one gradient at a time (no batched gradients). The C++ autograd ops
(``csrc/common/fused_backward.hpp`` guards their backwards) raise these
messages, which :func:`~kcla_mm.ops.ext_loader.get_ext` hands them."""

TORCH_OPS_REMEDY = (
    "run the model's KCLA layers on PyTorch ops (kcla_impl='torch' in "
    "ResNetKCLA and KCLAFPN, impl='torch' in KCLALayer and "
    'KCLADecoderAttention)')
SECOND_ORDER_ERROR = (
    "KCLA's fused kernels have no second derivative: a gradient taken "
    'with create_graph=True (a gradient penalty, a Hessian-vector product) '
    f'cannot be differentiated through them; {TORCH_OPS_REMEDY}')
BATCHED_GRAD_ERROR = (
    "KCLA's fused kernels take one gradient at a time, not batched ones "
    '(torch.autograd.grad(..., is_grads_batched=True), '
    'torch.autograd.functional.jacobian / hessian with vectorize=True); '
    f'{TORCH_OPS_REMEDY}, or leave vectorize off')
