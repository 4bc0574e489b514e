"""mmengine runner components."""
from .rng_state_hook import TorchRNGStateHook

__all__ = ['TorchRNGStateHook']
