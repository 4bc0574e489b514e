"""mmcv's fuse_conv_bn (mmdet's benchmark ``--fuse-conv-bn``) keeps what
the models compute (every shipped config: ``tests/test_configs``).

It folds every BN child into the Conv2d child registered just before it.
The layer attentions' BNs normalise more than their conv's output (the
gate, the attention's mix, MRLA-light's shortcut) and the KCLA adapter's
matmul reads its conv's weight only, so those BNs must stay; the blocks'
BNs fold. BN statistics and affine parameters are random, so a wrong fold
shows.
"""
import copy

import pytest
import torch
import torch.nn as nn
from mmcv.cnn import fuse_conv_bn

from kcla_mm.models import ResNetKCLA
from .test_export import DecoderPass, build_fpn, fpn_inputs


def randomise_bn(model: nn.Module) -> nn.Module:
    """``model`` in eval mode, its BNs' statistics and affine parameters
    drawn at random."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def num_bns(model: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def assert_fusion_keeps_outputs(model: nn.Module, run=None, *inputs,
                                rtol=1e-10, atol=1e-12) -> nn.Module:
    """``run(model)`` (default ``model(*inputs)``, a sequence of tensors)
    equals ``run`` of ``fuse_conv_bn(model)`` (``atol`` relative to each
    tensor's largest value); returns the fused model."""
    run = run or (lambda m: m(*inputs))
    with torch.no_grad():
        expected = run(model)
        fused = fuse_conv_bn(copy.deepcopy(model))
        got = run(fused)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=rtol,
                                   atol=atol * float(b.abs().max()))
    return fused


@pytest.mark.parametrize('layer_attention', ['KCLA', 'MRLA-light', 'LA',
                                             None])
def test_backbone(layer_attention):
    torch.manual_seed(0)
    model = randomise_bn(
        ResNetKCLA(18, base_channels=16, head_dim=16,
                   layer_attention=layer_attention).double())
    fused = assert_fusion_keeps_outputs(
        model, None, torch.rand(2, 3, 64, 64, dtype=torch.float64))
    # the stem's and blocks' 17 BNs fold (20 with the 3 downsamples); the
    # attention layers' (and KCLA's adapters') stay
    attention_bns = num_bns(model) - 20
    assert attention_bns == {'KCLA': 11, 'MRLA-light': 8, 'LA': 8,
                             None: 0}[layer_attention]
    assert num_bns(fused) == attention_bns


def test_kcla_fpn():
    torch.manual_seed(0)
    assert_fusion_keeps_outputs(randomise_bn(build_fpn()), None,
                                *fpn_inputs())


def test_kcla_decoder_attention():
    torch.manual_seed(0)
    assert_fusion_keeps_outputs(randomise_bn(DecoderPass().double()), None,
                                *DecoderPass.inputs())
