"""setup.py's ``kcla_mm/.mim``: symlinks to configs/, tools/ and
model-index.yml for an editable install, copies without the development
tools for a wheel or sdist, and nothing for other commands; a copy made
over the symlinks leaves the sources as they were."""
import os
import os.path as osp
import runpy
import shutil

import pytest

from ..test_tools.helpers import tree_snapshot

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DEV_TOOLS = ('setup_env.sh', 'check_cuda_build.sh', 'gpu_check.sh')


@pytest.fixture
def checkout(tmp_path):
    """setup.py, configs/, tools/ and model-index.yml copied to tmp_path,
    with setup.py loaded from there (its ROOT is the copy)."""
    shutil.copy(osp.join(ROOT, 'setup.py'), tmp_path)
    shutil.copy(osp.join(ROOT, 'model-index.yml'), tmp_path)
    for folder in ('configs', 'tools'):
        shutil.copytree(osp.join(ROOT, folder), tmp_path / folder,
                        ignore=shutil.ignore_patterns('__pycache__'))
    (tmp_path / 'kcla_mm').mkdir()
    return tmp_path, runpy.run_path(str(tmp_path / 'setup.py'),
                                    run_name='setup')


def files_under(folder) -> set:
    return {osp.relpath(osp.join(d, f), folder)
            for d, _, fs in os.walk(folder) for f in fs}


@pytest.mark.parametrize('command', ['editable_wheel', 'develop'])
def test_editable_install_links_configs_tools_and_model_index(
        checkout, monkeypatch, command):
    root, setup = checkout
    monkeypatch.setattr('sys.argv', ['setup.py', command])
    setup['add_mim_extension']()
    mim = root / 'kcla_mm' / '.mim'
    for name in ('configs', 'tools', 'model-index.yml'):
        assert os.readlink(mim / name) == osp.join('..', '..', name)
        assert osp.samefile(mim / name, root / name)


@pytest.mark.parametrize('command', ['bdist_wheel', 'sdist'])
def test_wheel_and_sdist_copy_them_without_development_tools(
        checkout, monkeypatch, command):
    root, setup = checkout
    sources = tree_snapshot(root)
    monkeypatch.setattr('sys.argv', ['setup.py', 'editable_wheel'])
    setup['add_mim_extension']()
    monkeypatch.setattr('sys.argv', ['setup.py', command])
    setup['add_mim_extension']()
    mim = root / 'kcla_mm' / '.mim'
    assert not [p for p in mim.iterdir() if p.is_symlink()]
    assert files_under(mim / 'configs') == files_under(root / 'configs')
    assert files_under(mim / 'tools') == files_under(root / 'tools') - set(
        DEV_TOOLS)
    assert (mim / 'model-index.yml').read_bytes() == (
        root / 'model-index.yml').read_bytes()
    # the sources the symlinks pointed at are untouched
    assert {k: v for k, v in tree_snapshot(root).items()
            if not k.startswith(osp.join('kcla_mm', '.mim'))} == sources


def test_other_commands_leave_no_mim_folder(checkout, monkeypatch):
    root, setup = checkout
    for command in ('egg_info', 'dist_info', 'build_ext'):
        monkeypatch.setattr('sys.argv', ['setup.py', command])
        setup['add_mim_extension']()
    assert not (root / 'kcla_mm' / '.mim').exists()
