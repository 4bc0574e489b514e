from .checkpoint import (CheckpointMismatchError, KeyReport,
                         convert_official_state_dict, merge_resnet_state_dict,
                         publish_checkpoint, save_checkpoint_atomic)
from .compat import enable_cpu_distributed, register_checkpoint_safe_globals

__all__ = [
    'enable_cpu_distributed', 'register_checkpoint_safe_globals',
    'CheckpointMismatchError', 'KeyReport', 'convert_official_state_dict',
    'merge_resnet_state_dict', 'publish_checkpoint', 'save_checkpoint_atomic'
]
