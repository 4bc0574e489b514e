"""Registers kcla_mm's modules in the OpenMMLab registries.

The only module that touches mmdet's and mmseg's registries; each library
is optional, so kcla_mm works next to either alone (KCLAFPN, built on
mmdet's FPN, is imported only when mmdet is; the seg heads, datasets and
metric only with mmseg).
"""
from typing import Iterable, List

from mmengine.registry import HOOKS as ROOT_HOOKS
from mmengine.registry import MODELS as ROOT_MODELS
from mmengine.registry import Registry

from .engine import SafeLoadHook, TorchRNGStateHook
from .models import ResNetKCLA
from .models.layers import ExternalAttention

BACKBONES = (ResNetKCLA, )
# ResNet block plugins: mmcv's build_plugin_layer looks them up in
# mmengine's root MODELS (mmdet's and mmseg's registries fall back to it);
# likewise hooks in the root HOOKS.
PLUGINS = (ExternalAttention, )
HOOKS = (SafeLoadHook, TorchRNGStateHook)


def _register(registry: Registry, modules: Iterable[type]) -> None:
    for module in modules:
        if registry.module_dict.get(module.__name__) is not module:
            registry.register_module(module=module, force=True)


def register_all_modules() -> List[str]:
    """Register kcla_mm's models; return the libraries registered into."""
    registered = []
    _register(ROOT_MODELS, PLUGINS)
    _register(ROOT_HOOKS, HOOKS)
    registered.append('mmengine')
    try:
        from mmdet.registry import MODELS as MMDET_MODELS
    except ImportError:
        pass
    else:
        from .models.necks.kcla_fpn import KCLAFPN
        _register(MMDET_MODELS, BACKBONES + (KCLAFPN, ))
        registered.append('mmdet')
    try:
        from mmseg.registry import DATASETS as MMSEG_DATASETS
        from mmseg.registry import METRICS as MMSEG_METRICS
        from mmseg.registry import MODELS as MMSEG_MODELS
    except ImportError:
        pass
    else:
        from .datasets import (ISIC2017Dataset, ISIC2018Dataset,
                               KvasirSEGDataset)
        from .evaluation import LesionMetric
        from .models.heads import EAHead, ResUNetHead
        from .models.necks import KCLADecoderAttention
        _register(MMSEG_MODELS, BACKBONES +
                  (ResUNetHead, EAHead, KCLADecoderAttention))
        _register(MMSEG_DATASETS,
                  (ISIC2017Dataset, ISIC2018Dataset, KvasirSEGDataset))
        _register(MMSEG_METRICS, (LesionMetric, ))
        registered.append('mmseg')
    return registered
