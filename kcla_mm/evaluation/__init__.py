"""Evaluation metrics (registered into mmseg's METRICS by registration)."""
from .metrics import LesionMetric

__all__ = ['LesionMetric']
