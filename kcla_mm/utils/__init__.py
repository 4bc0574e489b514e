from .compat import enable_cpu_distributed, register_checkpoint_safe_globals

__all__ = ['enable_cpu_distributed', 'register_checkpoint_safe_globals']
