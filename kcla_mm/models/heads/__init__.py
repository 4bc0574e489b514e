"""mmseg decode heads (importing this package requires mmseg)."""
from .ea_head import EAHead
from .unet_head import ResUNetHead

__all__ = ['EAHead', 'ResUNetHead']
