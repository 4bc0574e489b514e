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


@pytest.mark.parametrize('name, config, description', [
    ('train.py', DEMO_CONFIG, 'Train a detector'),
    ('train.py', SEG_DEMO_CONFIG, 'Train a segmentor'),
    ('test.py', DEMO_CONFIG, 'MMDet test (and eval) a model'),
    ('test.py', SEG_DEMO_CONFIG, 'MMSeg test (and eval) a model'),
])
def test_config_gets_its_librarys_own_script(name, config, description,
                                             tmp_path):
    """The arguments after the config reach the library's script: its own
    --help, which names the library's task (run in an empty folder: no
    dataset is needed)."""
    result = subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', name), config, '--help'],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f'\n{description}\n' in result.stdout
    assert '--cfg-options' in result.stdout
