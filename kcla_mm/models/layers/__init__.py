from .eca import build_eca_conv, eca_kernel_size
from .external_attention import ExternalAttention
from .kcla import KCLALayer, KCLAStateAdapter, layer_weights
from .layer_attention import LayerAttention, softmax_layer_attention
from .mrla import MRLALight
from .state import KCLAState, LayerAttentionCache

__all__ = [
    'build_eca_conv', 'eca_kernel_size', 'ExternalAttention', 'KCLALayer',
    'KCLAStateAdapter', 'layer_weights', 'LayerAttention',
    'softmax_layer_attention', 'MRLALight', 'KCLAState', 'LayerAttentionCache'
]
