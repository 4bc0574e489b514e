from .lesion_metric import LesionMetric

__all__ = ['LesionMetric']
