"""kcla_mm: Key-Correlated Layer Attention for OpenMMLab (mmdet / mmseg)."""
from .utils import enable_cpu_distributed
from .version import __version__, version_info

enable_cpu_distributed()

from . import ops  # noqa: E402
from .models import ResNetKCLA  # noqa: E402
from .registration import register_all_modules  # noqa: E402

register_all_modules()

__all__ = ['__version__', 'version_info', 'ops', 'ResNetKCLA',
           'register_all_modules']
