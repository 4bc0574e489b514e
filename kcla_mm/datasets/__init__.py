"""Medical segmentation datasets (need mmsegmentation)."""
from .medical import ISIC2017Dataset, ISIC2018Dataset, KvasirSEGDataset

__all__ = ['ISIC2017Dataset', 'ISIC2018Dataset', 'KvasirSEGDataset']
