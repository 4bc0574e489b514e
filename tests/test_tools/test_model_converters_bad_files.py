"""The model tools (kcla_official_to_mm.py, resnet_to_kcla.py,
publish_model.py) given careless or hostile checkpoint files: each stops
with an ``error:`` message naming the problem and exit code 1, writes
nothing, creates no folder and leaves the source file as it was.

Covered for every tool: an output that is the source (the same path, a
symlink or a hard link to it; for publish_model, a republished file whose
hashed name is the source's); NaN and inf weights; integer weights; keys
that are not strings; a folder or a FIFO given as the checkpoint; a failure
under missing parent folders. publish_model also refuses output names
without a file name.
"""
import os
import os.path as osp
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from .helpers import ROOT, tree_snapshot
from .test_model_converters import (authors_r50,  # noqa: F401 (fixtures)
                                    tool, torchvision_r50)

TOOLS = ('kcla_official_to_mm', 'resnet_to_kcla', 'publish_model')
all_tools = pytest.mark.parametrize('name', TOOLS)


def argv(name, src, dst):
    extra = ['--depth', '50'] if name == 'resnet_to_kcla' else []
    return [str(src), str(dst), *extra]


def assert_refused(name, args, capsys, tmp_path, *fragments):
    """Exit code 1 with an ``error:`` message naming ``fragments``, no
    traceback, and nothing under ``tmp_path`` changed."""
    before = tree_snapshot(tmp_path)
    assert tool(name).main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith('error: ') and 'Traceback' not in err, err
    for fragment in fragments:
        assert fragment in err, err
    assert tree_snapshot(tmp_path) == before


def save(path, state_dict):
    torch.save(dict(state_dict=state_dict, meta=dict(epoch=1)), str(path))
    return str(path)


def small_state_dict():
    return {'conv1.weight': torch.randn(4, 3, 3, 3),
            'bn1.weight': torch.ones(4),
            'bn1.num_batches_tracked': torch.tensor(3)}


# --------------------------------------------------------------------------
# the source is never the output
# --------------------------------------------------------------------------
@pytest.mark.parametrize('name, source', [
    ('kcla_official_to_mm', 'authors_r50'),
    ('resnet_to_kcla', 'torchvision_r50'),
])
@pytest.mark.parametrize('how', ['same path', 'symlink', 'hard link'])
def test_output_that_is_the_source_is_refused(name, source, how, tmp_path,
                                              capsys, request):
    """With a source the tool converts: it would have replaced it."""
    src = str(tmp_path / 'src.pth')
    shutil.copy(request.getfixturevalue(source)[1], src)
    capsys.readouterr()  # what building the source logged
    dst = str(tmp_path / 'dst.pth')
    if how == 'same path':
        dst = src
    elif how == 'symlink':
        os.symlink(src, dst)
    else:
        os.link(src, dst)
    assert_refused(name, argv(name, src, dst), capsys, tmp_path,
                   f'{dst} is the source checkpoint {src}')


def test_republished_file_named_as_its_source_is_refused(tmp_path, capsys):
    """publish_model.py names its output by the content's hash: publishing
    a published file under its own stem would replace the source."""
    src = save(tmp_path / 'model.pth', small_state_dict())
    assert tool('publish_model').main([src, str(tmp_path / 'pub.pth')]) == 0
    [published] = [p for p in os.listdir(tmp_path) if p.startswith('pub-')]
    capsys.readouterr()
    assert_refused('publish_model',
                   [str(tmp_path / published), str(tmp_path / 'pub.pth')],
                   capsys, tmp_path, 'is the source checkpoint')


@pytest.mark.parametrize('out', ['', 'sub/', '.pth'])
def test_publish_name_without_a_file_name_is_refused(out, tmp_path, capsys,
                                                    monkeypatch):
    src = save(tmp_path / 'model.pth', small_state_dict())
    monkeypatch.chdir(tmp_path)
    assert_refused('publish_model', [src, out], capsys, tmp_path,
                   f'out_file {out!r} names no file')


# --------------------------------------------------------------------------
# weights: floating point, finite, string keys
# --------------------------------------------------------------------------
@all_tools
@pytest.mark.parametrize('value', [float('nan'), float('inf')])
def test_non_finite_weights_are_refused(name, value, tmp_path, capsys):
    state_dict = small_state_dict()
    state_dict['bn1.weight'][2] = value
    src = save(tmp_path / 'src.pth', state_dict)
    assert_refused(name, argv(name, src, tmp_path / 'out.pth'), capsys,
                   tmp_path, "'bn1.weight' holds NaN or inf")


@all_tools
def test_integer_weights_are_refused(name, tmp_path, capsys):
    state_dict = small_state_dict()
    state_dict['conv1.weight'] = torch.ones(4, 3, 3, 3, dtype=torch.int64)
    src = save(tmp_path / 'src.pth', state_dict)
    assert_refused(name, argv(name, src, tmp_path / 'out.pth'), capsys,
                   tmp_path, "'conv1.weight' is torch.int64, not floating "
                   'point')


@all_tools
def test_keys_that_are_not_strings_are_refused(name, tmp_path, capsys):
    state_dict = small_state_dict()
    state_dict[7] = torch.zeros(1)
    src = save(tmp_path / 'src.pth', state_dict)
    assert_refused(name, argv(name, src, tmp_path / 'out.pth'), capsys,
                   tmp_path, 'key 7 (int) is not a string')


# --------------------------------------------------------------------------
# what is given as the checkpoint
# --------------------------------------------------------------------------
@all_tools
def test_folder_given_as_the_checkpoint_is_named_a_folder(name, tmp_path,
                                                          capsys):
    folder = tmp_path / 'checkpoints'
    folder.mkdir()
    assert_refused(name, argv(name, folder, tmp_path / 'out.pth'), capsys,
                   tmp_path, f'{folder} is a directory, not a checkpoint '
                   'file')


@all_tools
def test_fifo_given_as_the_checkpoint_is_refused_without_waiting(name,
                                                                 tmp_path):
    """Run as a command, with a timeout: reading a FIFO blocks forever."""
    fifo = str(tmp_path / 'ckpt.pth')
    os.mkfifo(fifo)
    before = tree_snapshot(tmp_path)
    result = subprocess.run(
        [sys.executable,
         osp.join(ROOT, 'tools', 'model_converters', f'{name}.py'),
         *argv(name, fifo, tmp_path / 'out.pth')],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith('error: ')
    assert f'{fifo} is not a regular file' in result.stderr
    assert tree_snapshot(tmp_path) == before


@all_tools
def test_failure_leaves_no_parent_folders(name, tmp_path, capsys):
    state_dict = small_state_dict()
    state_dict['bn1.weight'][0] = float('nan')
    src = save(tmp_path / 'src.pth', state_dict)
    assert_refused(name, argv(name, src, tmp_path / 'a' / 'b' / 'out.pth'),
                   capsys, tmp_path, 'NaN or inf')


@pytest.mark.parametrize('name, source', [
    ('kcla_official_to_mm', 'authors_r50'),
    ('resnet_to_kcla', 'torchvision_r50'),
    ('publish_model', None),
])
@pytest.mark.parametrize('how', ['SIGTERM', 'SIGINT'])
def test_signal_during_the_write_leaves_nothing(name, source, how, tmp_path,
                                                capsys, request, monkeypatch):
    """A signal while the output is being written: the temporary file and
    the folders made for it are removed, the previous SIGTERM handler is
    back, and the tool reports it."""
    src = str(tmp_path / 'src.pth')
    if source is None:
        save(src, small_state_dict())
    else:
        shutil.copy(request.getfixturevalue(source)[1], src)
    capsys.readouterr()  # what building the source logged
    monkeypatch.setattr(
        os, 'fsync', lambda fd: os.kill(os.getpid(), getattr(signal, how)))
    assert_refused(name, argv(name, src, tmp_path / 'a' / 'b' / 'out.pth'),
                   capsys, tmp_path, 'interrupted', 'nothing written')
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
