"""Neck components. ``kcla_fpn`` (built on mmdet's FPN) is imported only
where mmdet is, by ``kcla_mm.registration``."""
from .kcla_decoder import KCLADecoderAttention

__all__ = ['KCLADecoderAttention']
