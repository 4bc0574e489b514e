"""EAHead: the EANet segmentation head (Guo et al. 2021) for mmseg."""
from typing import Optional, Sequence

from mmcv.cnn import ConvModule
from mmseg.models.decode_heads.decode_head import BaseDecodeHead
from torch import Tensor

from ..layers import ExternalAttention


class EAHead(BaseDecodeHead):
    """External-attention decode head, as in the authors' EANet.

    ``conv_in`` (k x k conv, norm, act: in_channels -> ea_channels), an
    :class:`ExternalAttention` (its 1x1 conv, norm and residual included),
    ``conv_out`` (k x k conv, norm, act: ea_channels -> channels), then
    mmseg's ``cls_seg`` (dropout, 1x1 conv to the classes). The authors'
    head on ResNet-50's stage 4 is ``in_channels=2048, ea_channels=512,
    channels=256, kernel_size=3``, 64 slots, one head, dropout 0.1.

    Args:
        ea_channels (int, optional): channels of the external attention.
            Defaults to ``channels``.
        num_slots (int): memory slots per head. Defaults to 64.
        num_heads (int): attention heads; must divide ``ea_channels``.
            Defaults to 1.
        double_normalization (bool): the paper's double normalisation
            (True) or one softmax over slots. Defaults to True.
        kernel_size (int): odd kernel size of ``conv_in`` and ``conv_out``.
            Defaults to 3 (the authors').
        **kwargs: mmseg's ``BaseDecodeHead`` arguments (``in_channels``,
            ``channels``, ``num_classes``, ``norm_cfg``, ``act_cfg``,
            ``dropout_ratio``, ``in_index``, ``loss_decode``, ...). The
            attention uses the head's ``norm_cfg`` (None: a biased 1x1
            conv without norm). ``input_transform='multiple_select'`` is
            not supported (one feature map goes in).

    Shapes:
        inputs: tuple of backbone features, the one at ``in_index`` (or
        their resized concatenation) (B, in_channels, H, W);
        output: (B, out_channels, H, W) logits.

    Example:
        >>> import torch
        >>> head = EAHead(in_channels=64, channels=32, num_classes=3)
        >>> tuple(head([torch.rand(2, 64, 16, 16)]).shape)
        (2, 3, 16, 16)
    """

    def __init__(self,
                 ea_channels: Optional[int] = None,
                 num_slots: int = 64,
                 num_heads: int = 1,
                 double_normalization: bool = True,
                 kernel_size: int = 3,
                 **kwargs) -> None:
        owner = type(self).__name__
        if kwargs.get('input_transform') == 'multiple_select':
            raise ValueError(f"{owner}: input_transform='multiple_select' "
                             "is not supported; allowed: None or "
                             "'resize_concat'")
        if not isinstance(kernel_size, int) or isinstance(kernel_size, bool) \
                or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f'{owner}: kernel_size must be a positive odd '
                             f'int, got {kernel_size!r}')
        super().__init__(**kwargs)
        ea_channels = self.channels if ea_channels is None else ea_channels
        if not isinstance(ea_channels, int) or isinstance(ea_channels, bool) \
                or ea_channels < 1:
            raise ValueError(f'{owner}: ea_channels must be a positive int '
                             f'or None (= channels), got {ea_channels!r}')
        convs = dict(
            kernel_size=kernel_size,
            padding=kernel_size // 2,
            conv_cfg=self.conv_cfg,
            norm_cfg=self.norm_cfg,
            act_cfg=self.act_cfg)
        self.conv_in = ConvModule(self.in_channels, ea_channels, **convs)
        try:
            self.ea = ExternalAttention(
                ea_channels,
                num_slots=num_slots,
                num_heads=num_heads,
                norm_cfg=self.norm_cfg,
                double_normalization=double_normalization)
        except ValueError as e:
            raise ValueError(f'{owner}: {e}') from e
        self.conv_out = ConvModule(ea_channels, self.channels, **convs)

    def forward(self, inputs: Sequence[Tensor]) -> Tensor:
        """Backbone features -> (B, out_channels, H, W) logits."""
        x = self.conv_in(self._transform_inputs(inputs))
        return self.cls_seg(self.conv_out(self.ea(x)))
