"""A deliberately naive implementation of docs/method.md, for the tests.

The history is a plain list of (per-head weights, tensor) pairs and every
aggregate is recomputed from the whole list, so it shares nothing with the
recurrent state of the code under test.
"""
import math

import torch
import torch.nn.functional as F

EPS = 1e-3


def naive_eca(pooled, weight):
    """Conv1d(1, 1, k, padding (k-1)/2, no bias) along channels, by hand."""
    k = weight.numel()
    p = (k - 1) // 2
    padded = F.pad(pooled, (p, p))
    c = pooled.shape[1]
    return torch.stack([
        sum(padded[:, ch + j] * weight.flatten()[j] for j in range(k))
        for ch in range(c)
    ], 1)


def naive_bn_eval(x, bn):
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return (x - bn.running_mean.view(1, -1, 1, 1)) * scale.view(
        1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)


def temperatures(g, lo=0.7, hi=1 / 0.7):
    if g == 1:
        return [lo]
    return [math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i /
                     (g - 1)) for i in range(g)]


def head_weight(key_head, s):
    return torch.exp(torch.clamp(key_head.norm(dim=1) * s, max=10.0))


def naive_kcla(layers, xs):
    """Run docs/method.md's equations over the layers (eval mode, no
    drop-path).

    The history is a plain list of (per-head weights, tensor) pairs; the
    aggregate is recomputed from the whole list at every layer.
    """
    history = []  # [(w (B, G), X (B, C, H, W))]
    outs = []
    for layer, x in zip(layers, xs):
        b, c, h, w = x.shape
        g = c // layer.head_dim
        d = layer.head_dim
        s = temperatures(g)
        pooled = x.mean((2, 3))
        q = naive_eca(pooled, layer.q_conv.weight)
        k = naive_eca(pooled, layer.k_conv.weight)
        if layer.adapter is not None:  # Algorithm 1: re-initialise
            ad = layer.adapter
            num = sum(
                wt.repeat_interleave(xx.shape[1] // wt.shape[1], 1).view(
                    b, -1, 1, 1) * xx for wt, xx in history)
            den = sum(wt for wt, _ in history)
            a = num / den.repeat_interleave(num.shape[1] // den.shape[1],
                                            1).view(b, -1, 1, 1)
            if ad.resize:
                a = F.interpolate(a, size=x.shape[2:], mode='bilinear',
                                  align_corners=False)
            if ad.conv is not None:
                a = F.conv2d(a, ad.conv.weight, stride=ad.conv.stride,
                             groups=ad.conv.groups)
            a = naive_bn_eval(a, getattr(ad, ad.norm_name))
            ku = naive_eca(a.mean((2, 3)), ad.k_conv.weight)
            z = torch.stack([
                head_weight(ku[:, i * d:(i + 1) * d], s[i]) for i in range(g)
            ], 1)
            history = [(z, a)]
        wts = torch.stack(
            [head_weight(k[:, i * d:(i + 1) * d], s[i]) for i in range(g)],
            1)
        history.append((wts, x))
        agg = torch.zeros_like(x)
        gate_in = x.new_zeros(b, g)
        for i in range(g):
            sl = slice(i * d, (i + 1) * d)
            num = sum(wt[:, i].view(b, 1, 1, 1) * xx[:, sl]
                      for wt, xx in history)
            den = sum(wt[:, i] for wt, _ in history)
            agg[:, sl] = num / (den.view(b, 1, 1, 1) + EPS)
            gate_in[:, i] = (q[:, sl] * k[:, sl]).sum(1) / k[:, sl].norm(
                dim=1)
        o = F.conv2d(agg, layer.v_conv.weight, padding=1, groups=c)
        gate = torch.sigmoid(gate_in @ layer.gate.weight.t())
        o = o * gate.repeat_interleave(d, 1).view(b, c, 1, 1)
        y = F.relu(naive_bn_eval(o, layer.norm))
        outs.append(x + y)
    return outs


def randomise(layer, seed):
    gen = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.5
    for m in layer.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean = torch.randn(m.num_features, generator=gen) * 0.1
            m.running_var = torch.rand(m.num_features, generator=gen) + 0.5
    return layer
