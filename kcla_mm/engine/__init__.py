"""mmengine runner components."""
from .rng_state_hook import TorchRNGStateHook
from .safe_load_hook import SafeLoadHook

__all__ = ['SafeLoadHook', 'TorchRNGStateHook']
