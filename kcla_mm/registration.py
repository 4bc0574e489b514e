"""Registers kcla_mm's modules in the OpenMMLab registries.

The only module that touches mmdet's and mmseg's registries; each library
is optional, so kcla_mm works next to either alone (the necks, built on
mmdet's FPN, are imported only when mmdet is).
"""
from typing import Iterable, List

from mmengine.registry import Registry

from .models import ResNetKCLA

BACKBONES = (ResNetKCLA, )


def _register(registry: Registry, modules: Iterable[type]) -> None:
    for module in modules:
        if registry.module_dict.get(module.__name__) is not module:
            registry.register_module(module=module, force=True)


def register_all_modules() -> List[str]:
    """Register kcla_mm's models; return the libraries registered into."""
    registered = []
    try:
        from mmdet.registry import MODELS as MMDET_MODELS
    except ImportError:
        pass
    else:
        from .models.necks import KCLAFPN
        _register(MMDET_MODELS, BACKBONES + (KCLAFPN, ))
        registered.append('mmdet')
    try:
        from mmseg.registry import MODELS as MMSEG_MODELS
    except ImportError:
        pass
    else:
        _register(MMSEG_MODELS, BACKBONES)
        registered.append('mmseg')
    return registered
