from .ext_loader import ext_device_types, get_ext, has_device_impl, load_ext
from .kcla_state import kcla_state_update, kcla_state_update_reference


def ext_available() -> bool:
    """Whether ``kcla_mm._ext`` is built and importable."""
    return get_ext() is not None


__all__ = [
    'ext_available', 'ext_device_types', 'get_ext', 'has_device_impl',
    'load_ext', 'kcla_state_update', 'kcla_state_update_reference'
]
