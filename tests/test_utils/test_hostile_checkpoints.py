"""Hostile checkpoints are refused by every way kcla_mm loads one, and leave
the process as it was.

Each file is a real torch zip checkpoint whose pickle is written opcode by
opcode (protocol 2, as ``torch.save`` writes). The attacks: ``getattr``
walks from an allowed object to ``builtins`` or to a module's globals and
rewrites them with SETITEM (switching off torch's ``weights_only`` default
for the rest of the process, or planting a name in ``builtins``); REDUCE of
``os.system``, ``eval``, ``exec`` and ``subprocess.Popen``, named directly or
reached through ``getattr``; and allowed objects used as containers (a
HistoryBuffer whose pickled statistics replace the ones every HistoryBuffer
shares, or that carries a function or an object array).

The ways in: ``torch.load`` after ``import kcla_mm`` (torch's default
``weights_only=True``), mmengine's ``load_checkpoint``, torch.load inside
``allow_mmengine_checkpoints()``, a runner with the configs'
``SafeLoadHook`` (``resume`` and ``load_checkpoint``) and the three model
converters. After
each refusal torch's, builtins', mmengine's and kcla_mm's module state is
unchanged and a second malicious file (``os.system``) is still refused.
"""
import builtins
import json
import os.path as osp
import pickle
import struct
import sys
import types
from functools import lru_cache

import numpy as np
import pytest
import torch
import torch._utils
import torch.nn as nn
import torch.serialization
from mmengine.logging import HistoryBuffer
from mmengine.runner import load_checkpoint

import kcla_mm.utils.safe_load
from kcla_mm.utils import allow_mmengine_checkpoints

from ..test_tools.helpers import load_tool
from .test_checkpoint_resume import make_runner

MARKER = 'kcla_mm_hostile_marker'


# --------------------------------------------------------------------------
# pickle programs, opcode by opcode
# --------------------------------------------------------------------------
def glob(module, name):
    return b'c' + f'{module}\n{name}\n'.encode()


def text(value):
    data = value.encode()
    return b'X' + struct.pack('<I', len(data)) + data


def call(func, *args):
    """REDUCE: ``func(*args)``."""
    return func + b'(' + b''.join(args) + b'tR'


def attr(obj, name):
    return call(glob('builtins', 'getattr'), obj, text(name))


def set_item(mapping, key, value):
    """SETITEM: ``mapping[key] = value``; leaves ``mapping``."""
    return mapping + text(key) + value + b's'


def history_buffer(state):
    """NEWOBJ of HistoryBuffer, then BUILD with ``state``."""
    return glob('mmengine.logging.history_buffer', 'HistoryBuffer') + \
        b')\x81' + state + b'b'


def dict_of(**items):
    return b'}(' + b''.join(text(k) + v for k, v in items.items()) + b'u'


BUILTINS = attr(glob('builtins', 'getattr'), '__self__')
# np.array([None], dtype=object) as numpy pickles an array, but with the
# dtype made by a call alone (numpy's own pickle also BUILDs it, which torch
# refuses for the object dtype's class)
RECONSTRUCT = np.zeros(1).__reduce__()[0]  # numpy's _reconstruct
OBJECT_ARRAY = call(
    glob(RECONSTRUCT.__module__, RECONSTRUCT.__name__),
    glob('numpy', 'ndarray'), b'K\x00\x85',
    call(glob('_codecs', 'encode'), text('b'), text('latin1'))) + \
    b'(K\x01K\x01\x85' + call(glob('numpy', 'dtype'), text('O'), b'\x89',
                               b'\x88') + b'\x89]Natb'



def shell(command):
    return call(glob('os', 'system'), text(command))


HOSTILE = {
    'getattr walks to builtins.eval':
    attr(BUILTINS, 'eval'),
    'SETITEM switches weights_only off for the process':
    set_item(attr(glob('torch.serialization', '_get_layout'), '__globals__'),
             '_default_to_weights_only', attr(BUILTINS, 'callable')),
    'SETITEM plants a name in builtins':
    set_item(attr(BUILTINS, '__dict__'), MARKER, text('planted')),
    'SETITEM into torch._utils globals':
    set_item(attr(glob('torch._utils', '_rebuild_tensor_v2'), '__globals__'),
             MARKER, text('planted')),
    'REDUCE os.system':
    shell('true'),
    'REDUCE eval':
    call(glob('builtins', 'eval'), text('1')),
    'REDUCE exec':
    call(glob('builtins', 'exec'), text('pass')),
    'REDUCE subprocess.Popen':
    call(glob('subprocess', 'Popen'), text('true')),
    'REDUCE eval reached by getattr':
    call(attr(BUILTINS, 'eval'), text('1')),
    'getattr walks from HistoryBuffer to its module':
    attr(attr(glob('mmengine.logging.history_buffer', 'HistoryBuffer'),
              '__init__'), '__globals__'),
    'HistoryBuffer replaces the shared mean':
    history_buffer(dict_of(statistics_methods=dict_of(mean=attr(
        glob('mmengine.logging.history_buffer', 'HistoryBuffer'), 'max')))),
    'HistoryBuffer adds a shared statistic':
    history_buffer(dict_of(statistics_methods=dict_of(
        **{MARKER: glob('torch._utils', '_rebuild_tensor_v2')}))),
    'HistoryBuffer carries a function':
    history_buffer(
        dict_of(_log_history=glob('torch._utils', '_rebuild_tensor_v2'))),
    'HistoryBuffer carries an object array':
    history_buffer(dict_of(_log_history=OBJECT_ARRAY)),
}

# what the refusal names, by whether mmengine's types are allowed
REASONS = {
    'getattr walks to builtins.eval':
    ('GLOBAL getattr was not an allowed global',
     "getattr(<function>, '__self__')"),
    'SETITEM switches weights_only off for the process':
    ('GLOBAL getattr was not an allowed global',
     "getattr(<function>, '__globals__')"),
    'SETITEM plants a name in builtins':
    ('GLOBAL getattr was not an allowed global',
     "getattr(<function>, '__self__')"),
    'SETITEM into torch._utils globals':
    ('GLOBAL getattr was not an allowed global',
     "getattr(<function>, '__globals__')"),
    'REDUCE os.system': ('whose module os is blocked', ) * 2,
    'REDUCE eval': ('GLOBAL eval was not an allowed global', ) * 2,
    'REDUCE exec': ('GLOBAL exec was not an allowed global', ) * 2,
    'REDUCE subprocess.Popen':
    ('GLOBAL subprocess.Popen was not an allowed global', ) * 2,
    'REDUCE eval reached by getattr':
    ('GLOBAL getattr was not an allowed global',
     "getattr(<function>, '__self__')"),
    'getattr walks from HistoryBuffer to its module':
    ('GLOBAL getattr was not an allowed global',
     "getattr(<type>, '__init__')"),
    'HistoryBuffer replaces the shared mean':
    ('HistoryBuffer was not an allowed global',
     "HistoryBuffer statistic 'mean' must be HistoryBuffer's own"),
    'HistoryBuffer adds a shared statistic':
    ('HistoryBuffer was not an allowed global',
     f"HistoryBuffer statistic '{MARKER}' must be HistoryBuffer's own"),
    'HistoryBuffer carries a function':
    ('HistoryBuffer was not an allowed global',
     "HistoryBuffer attribute '_log_history' must be ndarray, got function"),
    'HistoryBuffer carries an object array':
    ('HistoryBuffer was not an allowed global',
     "HistoryBuffer attribute '_log_history' must hold numbers, got dtype "
     'object'),
}


class RawPickler:
    """A ``pickle_module.Pickler`` for ``torch.save`` that writes the given
    program as the checkpoint's ``data.pkl``."""

    def __init__(self, file, protocol):
        self.file = file

    def dump(self, program):
        self.file.write(b'\x80\x02' + program + b'.')


RAW_PICKLE = types.ModuleType('raw_pickle')
RAW_PICKLE.Pickler = RawPickler


def write_checkpoint(path, program) -> str:
    torch.save(program, str(path), pickle_module=RAW_PICKLE)
    return str(path)


# --------------------------------------------------------------------------
# the ways in: each raises, or (converters) prints, the refusal
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def runner(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp('runner')
    runner = make_runner(work_dir, max_iters=2)  # with SafeLoadHook
    # resume() needs the optimizer and schedulers the training loop builds
    runner.train()
    assert 'load_checkpoint' in vars(runner)  # the hook's wrapper
    return runner


@lru_cache()
def converter(name):
    return load_tool(name, 'model_converters')


def run_converter(name, args, capsys):
    out = str(args[-1]) + '.out.pth'
    extra = ['--depth', '50'] if name == 'resnet_to_kcla' else []
    assert converter(name).main([args[0], out, *extra]) == 1
    assert not osp.exists(out)
    raise pickle.UnpicklingError(capsys.readouterr().err)


def load_allowed(path):
    with allow_mmengine_checkpoints():
        return torch.load(path)


ENTRY_POINTS = {
    # name: (load(path, runner, capsys), whether mmengine's types are allowed)
    'torch.load': (lambda p, r, c: torch.load(p), False),
    'mmengine load_checkpoint':
    (lambda p, r, c: load_checkpoint(nn.Linear(4, 1), p), False),
    'allow_mmengine_checkpoints': (lambda p, r, c: load_allowed(p), True),
    'runner.resume (SafeLoadHook)': (lambda p, r, c: r.resume(p), True),
    'runner.load_checkpoint (SafeLoadHook)':
    (lambda p, r, c: r.load_checkpoint(p), True),
    'kcla_official_to_mm':
    (lambda p, r, c: run_converter('kcla_official_to_mm', [p], c), True),
    'resnet_to_kcla':
    (lambda p, r, c: run_converter('resnet_to_kcla', [p], c), True),
    'publish_model':
    (lambda p, r, c: run_converter('publish_model', [p], c), True),
}


# --------------------------------------------------------------------------
# what must not change
# --------------------------------------------------------------------------
def module_state():
    """Every module dict an attack could rewrite, by value identity, and
    torch's and mmengine's process-wide tables."""
    modules = (builtins, torch.serialization, torch._utils,
               sys.modules['mmengine.logging.history_buffer'],
               kcla_mm.utils.safe_load)
    return (
        {m.__name__: {k: id(v) for k, v in vars(m).items()}
         for m in modules},
        dict(HistoryBuffer._statistics_methods),
        set(torch.serialization.get_safe_globals()),
    )


@pytest.fixture
def guarded_process():
    """Asserts the test left the process as it found it; undoes what an
    attack that got through changed, so one failure does not spread."""
    default_to_weights_only = torch.serialization._default_to_weights_only
    statistics = dict(HistoryBuffer._statistics_methods)
    safe_globals = list(torch.serialization.get_safe_globals())
    before = module_state()
    yield
    after = module_state()
    torch.serialization._default_to_weights_only = default_to_weights_only
    for module in (builtins, torch._utils):
        if hasattr(module, MARKER):
            delattr(module, MARKER)
    HistoryBuffer._statistics_methods.clear()
    HistoryBuffer._statistics_methods.update(statistics)
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(safe_globals)
    assert after == before


@pytest.mark.parametrize('entry', list(ENTRY_POINTS))
@pytest.mark.parametrize('case', list(HOSTILE))
def test_hostile_checkpoint_is_refused(case, entry, tmp_path, runner, capsys,
                                       guarded_process):
    load, allowed = ENTRY_POINTS[entry]
    path = write_checkpoint(tmp_path / 'hostile.pth', HOSTILE[case])
    with pytest.raises(pickle.UnpicklingError) as error:
        load(path, runner, capsys)
    assert REASONS[case][allowed] in str(error.value)
    assert torch.serialization._default_to_weights_only(None) is True

    # a second, plainly malicious file is still refused by default
    marker = tmp_path / 'ran'
    second = write_checkpoint(tmp_path / 'second.pth',
                              shell(f'touch {marker}'))
    with pytest.raises(pickle.UnpicklingError, match='module os is blocked'):
        torch.load(second)
    assert not marker.exists()


def test_allow_mmengine_checkpoints_leaves_the_allow_list_as_it_was():
    """Inside the block the entries are allowed; after it (and after an
    error inside it) torch's list is what it was, including an entry the
    caller allowed before."""
    mine = (HistoryBuffer, 'mmengine.logging.history_buffer.HistoryBuffer')
    torch.serialization.add_safe_globals([mine])
    try:
        before = set(torch.serialization.get_safe_globals())
        with pytest.raises(RuntimeError, match='inside'):
            with allow_mmengine_checkpoints():
                inside = set(torch.serialization.get_safe_globals())
                assert mine in inside and len(inside) > len(before)
                raise RuntimeError('inside')
        assert set(torch.serialization.get_safe_globals()) == before
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(list(before - {mine}))


def test_import_kcla_mm_allows_nothing():
    """A fresh interpreter: ``import kcla_mm`` (with the registration every
    config triggers) adds nothing to torch's allow-list beyond torch's own
    (torch lists its nested and distributed tensor types as their modules
    are imported) and leaves its ``weights_only`` default on."""
    import subprocess
    code = (
        'import json, mmdet.models, mmseg.models, torch\n'
        'before = set(torch.serialization.get_safe_globals())\n'
        'import kcla_mm\n'
        'added = set(torch.serialization.get_safe_globals()) - before\n'
        'print(json.dumps(sorted(f"{e.__module__}.{e.__qualname__}" '
        'if not isinstance(e, tuple) else e[1] for e in added)))\n'
        'print(torch.serialization._default_to_weights_only(None))\n')
    result = subprocess.run([sys.executable, '-c', code], check=True,
                            capture_output=True, text=True)
    added, default = result.stdout.splitlines()[-2:]
    assert default == 'True'
    assert all(name.startswith('torch.') for name in json.loads(added)), \
        added
