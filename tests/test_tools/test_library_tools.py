"""tools/train.py and tools/test.py: a kcla_mm config handed to the own
train.py/test.py of the library its default_scope names, and the errors
for a config they cannot run."""
import os.path as osp
import subprocess
import sys

import pytest

from .helpers import DEMO_CONFIG, ROOT

SEG_DEMO_CONFIG = osp.join(ROOT, 'configs', 'demo',
                           'res-unet_r18s-kcla_synthetic-isic2018.py')


def run_tool(name, *args):
    return subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', name), *map(str, args)],
        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize('name', ['train.py', 'test.py'])
def test_help_names_the_config_and_no_gpus_option(name):
    # mim train adds --gpus to the command line when the help mentions it
    result = run_tool(name, '-h')
    assert result.returncode == 0
    assert f'usage: {name} CONFIG' in result.stdout
    assert '--gpus' not in result.stdout


@pytest.mark.parametrize('name', ['train.py', 'test.py'])
def test_no_arguments_prints_usage_and_fails(name):
    result = run_tool(name)
    assert result.returncode == 2
    assert f'usage: {name} CONFIG' in result.stdout


@pytest.mark.parametrize('name', ['train.py', 'test.py'])
def test_missing_config_is_named(name, tmp_path):
    missing = tmp_path / 'nowhere.py'
    result = run_tool(name, missing)
    assert result.returncode == 1
    assert f'error: config file {missing} not found' in result.stderr


def test_config_of_another_library_is_refused(tmp_path):
    config = tmp_path / 'cls.py'
    config.write_text("default_scope = 'mmpretrain'\nmodel = dict()\n")
    result = run_tool('train.py', config)
    assert result.returncode == 1
    assert (f"error: {config} has default_scope='mmpretrain'; kcla_mm runs "
            'configs of mmdet or mmseg') in result.stderr


@pytest.mark.parametrize('config, library', [(DEMO_CONFIG, 'mmdet'),
                                             (SEG_DEMO_CONFIG, 'mmseg')])
def test_config_runs_its_librarys_own_script(config, library, tmp_path):
    """The library's test.py, reached with the same arguments, fails on a
    checkpoint that does not exist (mmengine's loader names it)."""
    missing = tmp_path / 'missing.pth'
    result = run_tool('test.py', config, missing, '--work-dir', tmp_path)
    assert result.returncode == 1
    assert f'{library}/.mim/tools/test.py' in result.stderr
    assert f'FileNotFoundError: {missing} can not be found.' in result.stderr
