from .checkpoint import (CheckpointMismatchError, KeyReport,
                         convert_official_state_dict, merge_resnet_state_dict,
                         publish_checkpoint, save_checkpoint_atomic)
from .compat import enable_cpu_distributed
from .safe_load import allow_mmengine_checkpoints

__all__ = [
    'allow_mmengine_checkpoints', 'enable_cpu_distributed',
    'CheckpointMismatchError', 'KeyReport', 'convert_official_state_dict',
    'merge_resnet_state_dict', 'publish_checkpoint', 'save_checkpoint_atomic'
]
