"""Necks built on mmdet's (importing this package requires mmdet)."""
from .kcla_fpn import KCLAFPN

__all__ = ['KCLAFPN']
