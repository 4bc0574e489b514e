"""torch.export exports the KCLA models with the reference PyTorch ops.

torch.export cannot run the extension's calls (its fake tensors have no
data), so while it exports a KCLA layer takes its PyTorch path whatever
``impl`` says (``kcla_mm.ops.ext_loader.torch_ops_only``). The exported
program is run on a second input, so a graph that had recorded the first
input's results as constants would fail.
"""
import pytest
import torch
import torch.nn as nn

from kcla_mm.models import ResNetKCLA
from kcla_mm.models.necks import KCLADecoderAttention
from kcla_mm.models.necks.kcla_fpn import KCLAFPN


def assert_exports(model: nn.Module, make_inputs, strict: bool) -> None:
    """``model`` (float64) exported from one input equals it on another."""
    torch.manual_seed(1)
    program = torch.export.export(model, make_inputs(), strict=strict)
    inputs = make_inputs()
    with torch.no_grad():
        expected = model(*inputs)
    got = program.module()(*inputs)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('impl,strict', [('auto', False), ('auto', True),
                                         ('fused', False)])
def test_resnet_kcla_exports(impl, strict):
    # four stages: the first layer, continued states, three adapters
    torch.manual_seed(0)
    model = ResNetKCLA(18, base_channels=16, head_dim=16,
                       kcla_impl=impl).double().eval()
    assert_exports(
        model, lambda: (torch.rand(2, 3, 64, 64, dtype=torch.float64), ),
        strict)


def build_fpn() -> KCLAFPN:
    """A float64 KCLAFPN over three levels (:func:`fpn_inputs`)."""
    return KCLAFPN([16, 32, 64], 32, num_outs=4, head_dim=16).double()


def fpn_inputs() -> tuple:
    """``(levels, )``: :func:`build_fpn`'s arguments, drawn afresh."""
    return (tuple(
        torch.rand(2, c, s, s, dtype=torch.float64)
        for c, s in ((16, 32), (32, 16), (64, 8))), )


def test_kcla_fpn_exports():
    torch.manual_seed(0)
    assert_exports(build_fpn().eval(), fpn_inputs, strict=False)


class DecoderPass(nn.Module):
    """Two decoder levels of KCLADecoderAttention, returning tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = KCLADecoderAttention([32, 16], head_dim=16)

    def forward(self, coarse, fine):
        d0, state = self.attn(coarse, 0)
        d1, state = self.attn(fine, 1, state)
        return d0, d1, state.u, state.z

    @staticmethod
    def inputs() -> tuple:
        """A coarse and a fine level (float64), drawn afresh."""
        return (torch.rand(2, 32, 8, 8, dtype=torch.float64),
                torch.rand(2, 16, 16, 16, dtype=torch.float64))


def test_kcla_decoder_attention_exports():
    torch.manual_seed(0)
    assert_exports(DecoderPass().double().eval(), DecoderPass.inputs,
                   strict=False)
