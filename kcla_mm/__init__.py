"""kcla_mm: Key-Correlated Layer Attention for OpenMMLab (mmdet / mmseg)."""
from . import ops
from .models import ResNetKCLA
from .registration import register_all_modules
from .version import __version__, version_info

register_all_modules()

__all__ = ['__version__', 'version_info', 'ops', 'ResNetKCLA',
           'register_all_modules']
