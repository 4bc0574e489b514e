from .backbones import ResNetKCLA
from .layers import KCLALayer, KCLAState, LayerAttention, MRLALight

__all__ = ['ResNetKCLA', 'KCLALayer', 'KCLAState', 'LayerAttention',
           'MRLALight']
