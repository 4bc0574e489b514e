"""Every public option of kcla_mm's modules and dataset tools, given a bad
value, fails when the object is built (or the dataset loaded, or the CLI
parses its arguments) with a message that names the option, the value and
what is allowed.

The option lists are checked against the constructors' signatures (and the
CLIs' argparse parsers): a new option without a bad-value case here, or in
the commented exemption list of its class, fails
``test_every_option_has_a_bad_value_case``.
"""
import argparse
import inspect
import os.path as osp
import sys
from typing import NamedTuple, Optional, Tuple
from unittest import mock

import numpy as np
import pytest
from PIL import Image

from kcla_mm.datasets import (ISIC2017Dataset, ISIC2018Dataset,
                              KvasirSEGDataset)
from kcla_mm.evaluation import LesionMetric
from kcla_mm.models import ResNetKCLA
from kcla_mm.models.heads import EAHead, ResUNetHead
from kcla_mm.models.layers import ExternalAttention, KCLALayer
from kcla_mm.models.necks import KCLADecoderAttention
from kcla_mm.models.necks.kcla_fpn import KCLAFPN

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
sys.path.insert(0, osp.join(ROOT, 'tools', 'dataset_converters'))
import isic2017  # noqa: E402  isort:skip
import isic2018  # noqa: E402  isort:skip
import kvasir_seg  # noqa: E402  isort:skip
import make_synthetic_coco  # noqa: E402  isort:skip
import make_synthetic_lesions  # noqa: E402  isort:skip
sys.path.insert(0, osp.join(ROOT, 'tools', 'model_converters'))
import kcla_official_to_mm  # noqa: E402  isort:skip
import publish_model  # noqa: E402  isort:skip
import resnet_to_kcla  # noqa: E402  isort:skip

CONFIG_ERRORS = (ValueError, TypeError, KeyError)
UNSET = object()


class Case(NamedTuple):
    """One bad value: ``kwargs`` holds it (with any partner option of an
    inconsistent combination); the message must contain ``option``,
    ``shown`` (default: ``repr`` of ``kwargs[option]``) and ``allowed``."""
    option: str
    kwargs: dict
    allowed: str
    shown: object = UNSET
    error: Tuple[type, ...] = CONFIG_ERRORS

    def value_text(self) -> Optional[str]:
        if self.shown is not UNSET:
            return self.shown
        return repr(self.kwargs[self.option])


def cases(option, allowed, *values, **extra):
    """A Case per bad value of ``option`` (``extra``: partner options)."""
    return [Case(option, dict(extra, **{option: v}), allowed) for v in values]


def unknown_type(option, allowed='registered'):
    """A config dict whose 'type' no registry knows; the message names the
    type."""
    return Case(option, {option: dict(type='NoSuchType')}, allowed,
                shown="'NoSuchType'")


# --------------------------------------------------------------------------
# modules: class -> (builder, bad-value cases, exempt options)
# --------------------------------------------------------------------------
def build_resnet(**kwargs):
    return ResNetKCLA(**dict(dict(depth=18, base_channels=8, head_dim=8),
                             **kwargs))


RESNET_CASES = [
    *cases('depth', 'one of [18, 34, 50, 101, 152]', 42, '50'),
    *cases('in_channels', 'a positive int', 0, 3.0),
    *cases('stem_channels', 'a positive int or None', 0, -4),
    *cases('base_channels', 'a positive int', 0, True),
    *cases('stage_channels', 'a sequence of 4 ints >= 1', (8, 16),
           (8, 16, 0, 64), (8, 16, 'a', 64)),
    *cases('stem_stride', '1 or 2', 3, '2'),
    *cases('stem_pool', 'must be a bool', 'no'),
    *cases('with_stem_out', 'must be a bool', 1),
    *cases('num_stages', 'an int in [1, 4]', 0, 5, '4'),
    *cases('strides', 'a sequence of 4 ints >= 1', (1, 2), (1, 2, 0, 2)),
    *cases('dilations', 'a sequence of 4 ints >= 1', (1, 1, 0, 1)),
    *cases('out_indices', 'ints in [0, 3]', (0, 4), (), 2),
    # out_indices must fit num_stages (an inconsistent combination)
    Case('out_indices', dict(num_stages=2, strides=(1, 2), dilations=(1, 1),
                             out_indices=(0, 2)), 'ints in [0, 1]'),
    *cases('style', "'pytorch' or 'caffe'", 'tf'),
    *cases('deep_stem', 'must be a bool', 'yes'),
    *cases('avg_down', 'must be a bool', 'yes'),
    *cases('frozen_stages', 'an int in [-1, 4]', 7, -2, '1'),
    *cases('conv_cfg', "a config dict with a 'type'", 'Conv2d'),
    unknown_type('conv_cfg', 'registered'),
    *cases('norm_cfg', "a config dict with a 'type'", None, 'BN'),
    unknown_type('norm_cfg', 'registered'),
    *cases('norm_eval', 'must be a bool', 'yes'),
    *cases('dcn', "a config dict with a 'type'", 'DCN'),
    unknown_type('dcn', 'registered'),
    *cases('stage_with_dcn', 'one bool per stage', (False, ), 'no'),
    # with dcn, exactly one entry per stage
    Case('stage_with_dcn', dict(depth=50, dcn=dict(type='DCNv2'),
                                stage_with_dcn=(False, True, True, True,
                                                True)), 'one bool per stage'),
    *cases('plugins', 'a list of dicts', 'ContextBlock',
           [dict(type='ContextBlock')]),
    *cases('with_cp', 'must be a bool', 'yes'),
    *cases('zero_init_residual', 'must be a bool', 'yes'),
    *cases('layer_attention', "one of ('KCLA', 'LA', 'MRLA-light') or None",
           'SE', 'kcla'),
    *cases('head_dim', 'a positive int or None', 0, '8'),
    # head_dim must divide every stage width (named with the stage)
    Case('head_dim', dict(head_dim=12), 'divisors of 8', shown='head_dim=12'),
    *cases('temperature_range', '0 < s_min <= s_max', (2.0, 1.0), (0, 1),
           0.7),
    *cases('kcla_drop_path', 'a float in [0, 1)', 1.0, -0.1, '0.1'),
    *cases('kcla_norm_init', 'float > 0', 0.0, -1.0, True),
    *cases('state_init_blocks', 'containing 0', (11, ), (0, -1), 0),
    *cases('kcla_impl', "one of ('auto', 'fused', 'torch')", 'cuda'),
    Case('pretrained', dict(pretrained=3), 'a str or None', shown='int'),
    # pretrained and init_cfg together (inconsistent combination)
    Case('pretrained', dict(pretrained='a.pth',
                            init_cfg=dict(type='Pretrained', checkpoint='b')),
         'use init_cfg', shown='init_cfg'),
]
RESNET_EXEMPT = {
    # handled by mmengine's BaseModule (a bad one fails in init_weights)
    'init_cfg',
}


def build_fpn(**kwargs):
    return KCLAFPN(**dict(dict(in_channels=[16, 32], out_channels=32,
                               num_outs=3, head_dim=16), **kwargs))


FPN_CASES = [
    *cases('in_channels', 'a list of positive ints', 16, [16, 0]),
    *cases('out_channels', 'a positive int', 0, '32'),
    *cases('head_dim', 'a positive int', 0, '16'),
    *cases('head_dim', 'divisors of 32', 24),
    *cases('temperature_range', '0 < s_min <= s_max', (2.0, 1.0)),
    *cases('kcla_drop_path', 'a float in [0, 1)', 1.5),
    *cases('kcla_norm_cfg', "a config dict with a 'type'", None),
    unknown_type('kcla_norm_cfg', 'registered'),
    *cases('kcla_impl', "one of ('auto', 'fused', 'torch')", 'cuda'),
]
FPN_EXEMPT = {
    # mmdet FPN's own options (checked, or not, by mmdet)
    'num_outs', 'args', 'kwargs',
}


def build_decoder(**kwargs):
    return KCLADecoderAttention(
        **dict(dict(stage_channels=[32, 16], head_dim=16), **kwargs))


DECODER_CASES = [
    *cases('stage_channels', 'a non-empty sequence of positive ints', [],
           [32, 0], 32),
    *cases('head_dim', 'a positive int', 0),
    *cases('head_dim', 'divisors of 16', 32, stage_channels=[32, 16]),
    *cases('temperature_range', '0 < s_min <= s_max', (0, 1)),
    *cases('drop_path', 'a float in [0, 1)', 1.0),
    *cases('norm_cfg', "a config dict with a 'type'", 'BN'),
    *cases('norm_init', 'float > 0', 0),
    *cases('impl', "one of ('auto', 'fused', 'torch')", 'gpu'),
]
DECODER_EXEMPT = {'init_cfg'}  # mmengine's BaseModule


def build_seg_head(**cfg):
    import kcla_mm  # noqa: F401  (registers the heads)
    from mmengine.registry import DefaultScope
    from mmseg.registry import MODELS
    with DefaultScope.overwrite_default_scope('mmseg'):
        return MODELS.build(cfg)


def build_unet_head(**kwargs):
    return build_seg_head(**dict(
        dict(type='ResUNetHead', in_channels=[8, 16], in_index=[0, 1],
             channels=8, decoder_channels=[8], num_classes=2), **kwargs))


UNET_CASES = [
    *cases('in_channels', 'at least 2 positive ints', [8], [8, 0], 8),
    *cases('channels', 'must equal the last decoder stage', 16, '8'),
    *cases('decoder_channels', '1 positive ints', [8, 8], [0], (8.0, )),
    *cases('num_convs', 'an int >= 1', 0, True),
    *cases('decoder_attention', "a config dict with a 'type'", 'KCLA'),
    unknown_type('decoder_attention', 'registered module'),
    Case('decoder_attention',
         dict(decoder_attention=dict(type='KCLADecoderAttention', foo=1)),
         'unexpected keyword argument', shown="'foo'"),
    *cases('bottleneck_attention', "a config dict with a 'type'",
           ['ExternalAttention']),
    unknown_type('bottleneck_attention', 'registered module'),
    # mmseg's option, fixed by the head
    Case('input_transform', dict(input_transform='resize_concat'),
         "always 'multiple_select'", shown='input_transform'),
]
UNET_EXEMPT = {
    # BaseDecodeHead's arguments (num_classes, norm_cfg, ...), mmseg's
    'kwargs',
}


def build_ea_head(**kwargs):
    return build_seg_head(**dict(
        dict(type='EAHead', in_channels=8, channels=8, num_classes=2,
             num_slots=4), **kwargs))


EA_HEAD_CASES = [
    *cases('ea_channels', 'a positive int or None', 0, 2.5, True),
    *cases('num_slots', 'a positive int', 0, '4'),
    *cases('num_heads', 'a positive int', 0),
    *cases('num_heads', 'divisors of 8', 3),
    *cases('double_normalization', 'must be a bool', 'yes'),
    *cases('kernel_size', 'a positive odd int', 2, 0, True),
    Case('input_transform',
         dict(input_transform='multiple_select', in_channels=[8, 8],
              in_index=[0, 1]), "allowed: None or 'resize_concat'"),
]
EA_HEAD_EXEMPT = {'kwargs'}  # BaseDecodeHead's arguments, mmseg's


def build_ea(**kwargs):
    return ExternalAttention(**dict(dict(in_channels=16), **kwargs))


EA_CASES = [
    *cases('in_channels', 'a positive int', 0, 16.0),
    *cases('num_slots', 'a positive int', 0, 2.5),
    *cases('num_heads', 'a positive int', '2', True),
    *cases('num_heads', 'divisors of 16', 3),
    *cases('norm_cfg', "a config dict with a 'type'", 'BN'),
    unknown_type('norm_cfg', 'registered'),
    *cases('with_relu', 'must be a bool', None),
    *cases('zero_init', 'must be a bool', 0),
    *cases('double_normalization', 'must be a bool', 1),
    *cases('eps', 'a float >= 0', -1.0, '1e-9', float('nan')),
]
EA_EXEMPT = {'init_cfg'}  # mmengine's BaseModule


def build_layer(**kwargs):
    return KCLALayer(**dict(dict(channels=16, head_dim=8), **kwargs))


LAYER_CASES = [
    *cases('channels', 'a positive int', 0, -16, 16.0),
    *cases('head_dim', 'a positive int', 0, 8.0),
    *cases('head_dim', 'divisors of 16', 3),
    *cases('temperature_range', '0 < s_min <= s_max', (2.0, 1.0), (1.0, ),
           (0.5, float('inf'))),
    *cases('drop_path', 'a float in [0, 1)', 1.5, None),
    *cases('state_in_channels', 'a positive int or None', 0, -8, '8'),
    *cases('state_in_channels', 'multiples of 2', 9),
    *cases('state_stride', 'a positive int', 0, 1.5),
    *cases('state_resize', 'must be a bool', 'yes'),
    Case('state_resize', dict(state_in_channels=8, state_resize=True,
                              state_stride=2),
         'state_stride must be 1', shown='state_stride=2'),
    *cases('norm_cfg', "a config dict with a 'type'", None),
    unknown_type('norm_cfg', 'registered'),
    *cases('norm_init', 'float > 0', 0.0, True),
    *cases('eps', 'float >= 0', -1.0, float('nan')),
    *cases('key_eps', 'float > 0', 0.0, -1e-6),
    *cases('impl', "one of ('auto', 'fused', 'torch')", 'gpu', 'cuda'),
]
LAYER_EXEMPT = {'init_cfg'}  # mmengine's BaseModule

METRIC_CASES = [
    *cases('lesion_index', 'an int >= 0', -1, 1.0, True),
    *cases('ignore_index', 'an int', '255', None),
    Case('ignore_index', dict(ignore_index=1), 'must differ from '
         'lesion_index', shown='(1)'),
    *cases('collect_device', "one of ('cpu', 'gpu', 'npu')", 'tpu', 'cuda'),
    *cases('prefix', 'a str', 3),
]
METRIC_EXEMPT = set()

MODULES = {
    'ResNetKCLA': (ResNetKCLA, build_resnet, RESNET_CASES, RESNET_EXEMPT),
    'KCLAFPN': (KCLAFPN, build_fpn, FPN_CASES, FPN_EXEMPT),
    'KCLADecoderAttention': (KCLADecoderAttention, build_decoder,
                             DECODER_CASES, DECODER_EXEMPT),
    'ResUNetHead': (ResUNetHead, build_unet_head, UNET_CASES, UNET_EXEMPT),
    'EAHead': (EAHead, build_ea_head, EA_HEAD_CASES, EA_HEAD_EXEMPT),
    'ExternalAttention': (ExternalAttention, build_ea, EA_CASES, EA_EXEMPT),
    'KCLALayer': (KCLALayer, build_layer, LAYER_CASES, LAYER_EXEMPT),
    'LesionMetric': (LesionMetric, LesionMetric, METRIC_CASES,
                     METRIC_EXEMPT),
}


def module_params():
    for name, (_, build, bad, _) in MODULES.items():
        for i, case in enumerate(bad):
            yield pytest.param(name, build, case,
                               id=f'{name}-{case.option}-{i}')


def assert_names_all(message: str, case: Case) -> None:
    assert case.option in message, message
    if case.value_text() is not None:
        assert case.value_text() in message, message
    assert case.allowed in message, message


@pytest.mark.parametrize('owner,build,case', list(module_params()))
def test_bad_option_raises_naming_option_value_and_allowed(owner, build, case):
    with pytest.raises(case.error) as info:
        build(**case.kwargs)
    message = str(info.value)
    if isinstance(info.value, KeyError):
        message = info.value.args[0]
    assert message.startswith(owner) or owner in message, message
    assert_names_all(message, case)


# --------------------------------------------------------------------------
# datasets: the options of BinaryLesionDataset (all three datasets)
# --------------------------------------------------------------------------
DATASETS = (ISIC2017Dataset, ISIC2018Dataset, KvasirSEGDataset)
DATASET_CASES = [
    *cases('img_suffix', "a non-empty str such as '.jpg'", 3, '',
           ('.jpg', )),
    *cases('seg_map_suffix', "a non-empty str such as '.png'", None,
           ('.png', )),
    *cases('reduce_zero_label', 'must be a bool', 'no', 1),
    # a suffix no image has: found when the dataset lists its images
    Case('img_suffix', dict(img_suffix='.png'), 'check data_root, '
         'data_prefix and img_suffix', error=(FileNotFoundError, )),
]
DATASET_EXEMPT = {
    # BaseSegDataset's arguments (data_root, data_prefix, pipeline, ...)
    'kwargs',
}


@pytest.fixture(scope='module')
def one_sample_root(tmp_path_factory):
    root = tmp_path_factory.mktemp('lesions')
    (root / 'img_dir' / 'val').mkdir(parents=True)
    (root / 'ann_dir' / 'val').mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(
        root / 'img_dir' / 'val' / 'ISIC_0000000.jpg')
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(
        root / 'ann_dir' / 'val' / 'ISIC_0000000.png')
    return str(root)


def build_dataset(dataset, root, **kwargs):
    import kcla_mm  # noqa: F401
    from mmengine.registry import DefaultScope
    from mmseg.registry import DATASETS as REGISTRY
    with DefaultScope.overwrite_default_scope('mmseg'):
        return REGISTRY.build(
            dict(type=dataset.__name__, data_root=root,
                 data_prefix=dict(img_path='img_dir/val',
                                  seg_map_path='ann_dir/val'),
                 pipeline=[], **kwargs))


@pytest.mark.parametrize('dataset', DATASETS, ids=lambda d: d.__name__)
def test_datasets_build_with_good_options(dataset, one_sample_root):
    assert len(build_dataset(dataset, one_sample_root)) == 1


@pytest.mark.parametrize('dataset', DATASETS, ids=lambda d: d.__name__)
@pytest.mark.parametrize('case', DATASET_CASES,
                         ids=[f'{c.option}-{i}'
                              for i, c in enumerate(DATASET_CASES)])
def test_dataset_bad_option_raises_naming_it(dataset, case, one_sample_root):
    with pytest.raises(case.error) as info:
        build_dataset(dataset, one_sample_root, **case.kwargs)
    message = str(info.value)
    assert dataset.__name__ in message, message
    assert_names_all(message, case)


# --------------------------------------------------------------------------
# dataset converters / generators: CLI options
# --------------------------------------------------------------------------
class _ParserCaptured(Exception):
    pass


def cli_options(module) -> set:
    """The dests of ``module``'s argparse options (positionals included)."""
    captured = {}

    def grab(parser, *args, **kwargs):
        captured['parser'] = parser
        raise _ParserCaptured

    with mock.patch.object(argparse.ArgumentParser, 'parse_args', grab):
        with pytest.raises(_ParserCaptured):
            module.parse_args([])
    return {a.dest for a in captured['parser']._actions if a.dest != 'help'}


class CliCase(NamedTuple):
    """``argv`` (``{tmp}`` and ``{file}`` substituted) must exit != 0 with
    ``option``, ``shown`` and ``allowed`` on stderr."""
    option: str
    argv: Tuple[str, ...]
    shown: str
    allowed: Optional[str]


def cli_case(option, shown, allowed, *argv):
    return CliCase(option, argv, shown, allowed)


OUT = '{tmp}/out'
FULL = '{tmp}/full'  # an existing non-empty folder
MISSING = '{tmp}/no_downloads'
LESION_CONVERTER_CASES = [
    cli_case('src_dir', MISSING, 'missing download in src_dir', MISSING,
             OUT),
    cli_case('out_dir', FULL, 'pass --overwrite', '{tmp}', FULL),
    # out_dir == src_dir: --overwrite would delete the downloads
    cli_case('out_dir', FULL, 'allowed: a folder outside the downloads',
             FULL, FULL, '--overwrite'),
    cli_case('overwrite', "'yes'", None, '{tmp}', OUT, '--overwrite=yes'),
    cli_case('max_pixels', '0', 'must be an int in [1, ', '{tmp}', OUT,
             '--max-pixels', '0'),
    cli_case('max_pixels', "'big'", 'invalid int value', '{tmp}', OUT,
             '--max-pixels', 'big'),
]
SEEDED_CASES = [
    cli_case('seed', '-1', 'must be an int >= 0', '{tmp}', OUT, '--seed',
             '-1'),
    cli_case('seed', "'one'", 'invalid int value', '{tmp}', OUT, '--seed',
             'one'),
]
CLI_CASES = {
    'isic2017': (isic2017, LESION_CONVERTER_CASES),
    'isic2018': (isic2018, LESION_CONVERTER_CASES + SEEDED_CASES + [
        cli_case('split', "'offical'", "'official'", '{tmp}', OUT,
                 '--split', 'offical'),
    ]),
    'kvasir_seg': (kvasir_seg, LESION_CONVERTER_CASES + SEEDED_CASES + [
        cli_case('split', "'900-100'", "'880-120'", '{tmp}', OUT,
                 '--split', '900-100'),
    ]),
    'make_synthetic_lesions': (make_synthetic_lesions, [
        cli_case('out_dir', FULL, 'pass --overwrite', FULL, '--layout',
                 'kvasir', '--num', '1'),
        cli_case('layout', "'isic2019'", "'isic2018'", OUT, '--layout',
                 'isic2019'),
        cli_case('num_train', '0', '>= 1', OUT, '--layout', 'isic2017',
                 '--num-train', '0'),
        cli_case('num_val', '-1', '>= 0', OUT, '--layout', 'isic2018',
                 '--num-val', '-1'),
        cli_case('num_test', '0', '>= 1', OUT, '--layout', 'isic2017',
                 '--num-test', '0'),
        cli_case('num', '0', '>= 1', OUT, '--layout', 'kvasir', '--num', '0'),
        # --num belongs to the kvasir layout, --num-* to the ISIC ones
        cli_case('num', 'isic2017', 'use --num-train', OUT, '--layout',
                 'isic2017', '--num', '5'),
        cli_case('num_train', 'kvasir', 'use --num', OUT, '--layout',
                 'kvasir', '--num-train', '5'),
        cli_case('img_size', '8', '>= 32', OUT, '--layout', 'kvasir',
                 '--img-size', '8'),
        cli_case('seed', '-1', 'must be an int >= 0', OUT, '--layout',
                 'kvasir', '--seed', '-1'),
        cli_case('zip', "'1'", None, OUT, '--layout', 'kvasir', '--zip=1'),
        cli_case('overwrite', "'1'", None, OUT, '--layout', 'kvasir',
                 '--overwrite=1'),
    ]),
    'make_synthetic_coco': (make_synthetic_coco, [
        cli_case('out_dir', '{file}', 'pass --overwrite', '{file}'),
        cli_case('num_train', '0', '>= 1', OUT, '--num-train', '0'),
        cli_case('num_val', '-2', '>= 1', OUT, '--num-val', '-2'),
        cli_case('img_size', '32', '>= 64', OUT, '--img-size', '32'),
        cli_case('max_objects', '0', '>= 1', OUT, '--max-objects', '0'),
        cli_case('seed', '-1', 'must be an int >= 0', OUT, '--seed', '-1'),
        cli_case('overwrite', "'1'", None, OUT, '--overwrite=1'),
    ]),
}

# model converters: the path arguments' errors (missing or wrong
# checkpoints: 'checkpoint not found: <path>', mismatched keys) are tested
# in tests/test_tools/test_model_converters.py
OUT_PTH = '{tmp}/out.pth'
CLI_CASES.update({
    'kcla_official_to_mm': (kcla_official_to_mm, [
        cli_case('depth', '42', 'choose from 50, 101, 152', '{file}',
                 OUT_PTH, '--depth', '42'),
        cli_case('max_list', '0', 'must be an int >= 1', '{file}', OUT_PTH,
                 '--max-list', '0'),
        cli_case('unsafe_load', "'1'", None, '{file}', OUT_PTH,
                 '--unsafe-load=1'),
    ]),
    'resnet_to_kcla': (resnet_to_kcla, [
        cli_case('depth', '42', 'choose from 18, 34, 50, 101, 152', '{file}',
                 OUT_PTH, '--depth', '42'),
        cli_case('layer_attention', "'SE'", "'MRLA-light'", '{file}',
                 OUT_PTH, '--depth', '50', '--layer-attention', 'SE'),
        cli_case('head_dim', '0', 'must be an int >= 1', '{file}', OUT_PTH,
                 '--depth', '50', '--head-dim', '0'),
        cli_case('seed', '-1', 'must be an int >= 0', '{file}', OUT_PTH,
                 '--depth', '50', '--seed', '-1'),
        cli_case('max_list', '0', 'must be an int >= 1', '{file}', OUT_PTH,
                 '--depth', '50', '--max-list', '0'),
        cli_case('unsafe_load', "'1'", None, '{file}', OUT_PTH, '--depth',
                 '50', '--unsafe-load=1'),
    ]),
    'publish_model': (publish_model, [
        cli_case('keep_keys', "['meta']", 'must include state_dict',
                 '{file}', OUT_PTH, '--keep-keys', 'meta'),
        cli_case('unsafe_load', "'1'", None, '{file}', OUT_PTH,
                 '--unsafe-load=1'),
    ]),
})
CLI_EXEMPT = {name: {'src', 'dst'} for name in ('kcla_official_to_mm',
                                               'resnet_to_kcla')}
CLI_EXEMPT['publish_model'] = {'in_file', 'out_file'}


def cli_params():
    for name, (module, bad) in CLI_CASES.items():
        for i, case in enumerate(bad):
            yield pytest.param(module, case, id=f'{name}-{case.option}-{i}')


def option_text(dest: str) -> str:
    """How argparse and our messages spell an option: ``--num-train``; a
    positional (``src_dir``) as it is."""
    return dest if dest.endswith('_dir') else '--' + dest.replace('_', '-')


@pytest.mark.parametrize('module,case', list(cli_params()))
def test_cli_bad_option_exits_nonzero_naming_it(module, case, tmp_path,
                                                capsys):
    (tmp_path / 'full').mkdir()
    (tmp_path / 'full' / 'keep.txt').write_text('not a dataset')
    (tmp_path / 'a_file').write_text('')
    subs = dict(tmp=str(tmp_path), file=str(tmp_path / 'a_file'))
    argv = [a.format(**subs) for a in case.argv]
    try:
        code = module.main(argv)
    except SystemExit as e:  # argparse errors
        code = e.code
    err = capsys.readouterr().err
    assert code not in (0, None), err
    assert 'Traceback' not in err
    assert option_text(case.option) in err, err
    assert case.shown.format(**subs) in err, err
    if case.allowed is not None:
        assert case.allowed in err, err
    # nothing half-written next to the destination
    assert not (tmp_path / 'out').exists()


# --------------------------------------------------------------------------
# the option lists above cover every option
# --------------------------------------------------------------------------
def signature_options(cls) -> set:
    params = inspect.signature(cls.__init__).parameters
    return {name for name in params if name != 'self'}


@pytest.mark.parametrize('name', list(MODULES))
def test_every_option_has_a_bad_value_case(name):
    cls, _, bad, exempt = MODULES[name]
    covered = {case.option for case in bad} | exempt
    options = signature_options(cls)
    assert options - covered == set(), (
        f'{name}: options without a bad-value case or an exemption')
    assert not exempt - options, f'{name}: stale exemptions'


@pytest.mark.parametrize('dataset', DATASETS, ids=lambda d: d.__name__)
def test_every_dataset_option_has_a_bad_value_case(dataset):
    covered = {case.option for case in DATASET_CASES} | DATASET_EXEMPT
    assert signature_options(dataset) == covered


@pytest.mark.parametrize('name', list(CLI_CASES))
def test_every_cli_option_has_a_bad_value_case(name):
    module, bad = CLI_CASES[name]
    assert cli_options(module) == {case.option for case in bad} | \
        CLI_EXEMPT.get(name, set())
