from .resnet_blocks import BasicBlock, Bottleneck, make_res_layer
from .resnet_kcla import ResNetKCLA

__all__ = ['BasicBlock', 'Bottleneck', 'make_res_layer', 'ResNetKCLA']
