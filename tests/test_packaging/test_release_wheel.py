"""kcla_mm as a user installs a release.

The sdist is built from a clean copy of the repository (the files git
tracks or would track), the wheel from that sdist outside any checkout, and
the wheel is installed into a fresh virtualenv that sees the set-up's
torch, mmcv, mmdet and mmseg (a ``.pth`` line naming their site-packages)
but not the checkout. From a folder outside the checkout, kcla_mm and its
extension import, every shipped config is found by name as ``mim`` finds
it and builds, and openmim (from the registry) searches the model index
and runs the demo configs with ``mim run`` (data generators), ``mim
train`` and ``mim test``: kcla_mm's tools/train.py and tools/test.py,
which hand over to mmdet's or mmseg's own.
"""
import glob
import json
import os
import os.path as osp
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from email.parser import Parser
from types import SimpleNamespace

import pytest
import torch
import yaml

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SHIPPED_CONFIGS = sorted(
    osp.relpath(p, osp.join(ROOT, 'configs'))
    for p in glob.glob(osp.join(ROOT, 'configs', '*', '*.py'))
    if '_base_' not in p)
USER_TOOLS = ('train.py', 'test.py', 'dist_train.sh', 'demo.py',
              'seg_demo.py', 'dataset_converters/isic2017.py',
              'dataset_converters/isic2018.py',
              'dataset_converters/kvasir_seg.py',
              'dataset_converters/make_synthetic_coco.py',
              'dataset_converters/make_synthetic_lesions.py',
              'model_converters/resnet_to_kcla.py',
              'model_converters/kcla_official_to_mm.py',
              'model_converters/publish_model.py',
              'analysis/complexity.py', 'analysis/benchmark_kcla.py',
              'analysis/attention_maps.py', 'analysis/key_correlation.py')
DEV_TOOLS = ('setup_env.sh', 'check_cuda_build.sh', 'gpu_check.sh')
EXT_LIMIT = 4 * 10**6  # bytes

pytestmark = pytest.mark.slow


def version() -> str:
    with open(osp.join(ROOT, 'kcla_mm', 'version.py')) as f:
        return re.search(r"__version__ = '([^']+)'", f.read()).group(1)


def run(cmd, cwd, env=None, timeout=900) -> str:
    """Run ``cmd``; its output, or a failure showing the output's end."""
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, (
        f'{" ".join(map(str, cmd))} exited {result.returncode}:\n'
        f'{result.stdout[-3000:]}\n{result.stderr[-3000:]}')
    return result.stdout


def clean_copy(dest: str) -> str:
    """The files a clean clone of the checkout holds (tracked, or new and
    not ignored), copied to ``dest``."""
    listed = subprocess.run(
        ['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
        cwd=ROOT, capture_output=True, check=True).stdout.decode()
    for rel in filter(None, listed.split('\0')):
        src = osp.join(ROOT, rel)
        if osp.lexists(src):
            os.makedirs(osp.dirname(osp.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, osp.join(dest, rel), follow_symlinks=False)
    return dest


@pytest.fixture(scope='module')
def release(tmp_path_factory):
    """The sdist (from a clean copy) and the wheel (from the sdist)."""
    base = tmp_path_factory.mktemp('release')
    src = clean_copy(str(base / 'kcla_mm_src'))
    run([sys.executable, '-m', 'build', '--sdist', '--no-isolation', '-o',
         str(base / 'dist')], cwd=src)
    shutil.rmtree(src)  # the wheel must need nothing but the sdist
    sdist, = glob.glob(str(base / 'dist' / 'kcla_mm-*.tar.gz'))
    run([sys.executable, '-m', 'pip', 'wheel', '--no-build-isolation',
         '--no-deps', '--no-cache-dir', '--disable-pip-version-check',
         sdist, '-w', str(base / 'dist')], cwd=str(base))
    wheel, = glob.glob(str(base / 'dist' / 'kcla_mm-*.whl'))
    return SimpleNamespace(sdist=sdist, wheel=wheel)


@pytest.fixture(scope='module')
def user_env(release, tmp_path_factory):
    """A fresh virtualenv holding the wheel and openmim; ``run`` runs a
    command in a folder outside the checkout with only that venv's
    interpreter and scripts."""
    base = tmp_path_factory.mktemp('user')
    venv = str(base / 'venv')
    run([sys.executable, '-m', 'venv', '--without-pip', venv], cwd=str(base))
    python = osp.join(venv, 'bin', 'python')
    site = run([python, '-c', 'import sysconfig; '
                'print(sysconfig.get_paths()["purelib"])'],
               cwd=str(base)).strip()
    with open(osp.join(site, 'setup_env_packages.pth'), 'w') as f:
        f.write(sysconfig.get_paths()['purelib'] + '\n')
    pip = [sys.executable, '-m', 'pip', '--python', python, 'install',
           '--disable-pip-version-check']
    run(pip + ['--no-deps', release.wheel], cwd=str(base))
    record = osp.join(site, f'kcla_mm-{version()}.dist-info', 'RECORD')
    with open(record) as f:
        installed = [line.split(',')[0] for line in f]
    run(pip + ['openmim'], cwd=str(base))
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    env['PATH'] = osp.join(venv, 'bin') + os.pathsep + env['PATH']
    work = base / 'work'
    work.mkdir()

    def run_in_venv(*cmd, timeout=900):
        return run(list(cmd), cwd=str(work), env=env, timeout=timeout)

    mim_root = osp.join(site, 'kcla_mm', '.mim')
    return SimpleNamespace(python=python, site=site, installed=installed,
                           work=work, run=run_in_venv, mim_root=mim_root)


def test_wheel_holds_kcla_mm_configs_tools_and_model_index_only(release):
    with zipfile.ZipFile(release.wheel) as z:
        names = z.namelist()
        sizes = {i.filename: i.file_size for i in z.infolist()}
        metadata = Parser().parsestr(
            z.read(f'kcla_mm-{version()}.dist-info/METADATA').decode())
        tags = Parser().parsestr(
            z.read(f'kcla_mm-{version()}.dist-info/WHEEL').decode())
    assert {n.split('/')[0] for n in names} == {
        'kcla_mm', f'kcla_mm-{version()}.dist-info'}
    assert not [n for n in names if '/tests/' in n or '__pycache__' in n]
    mim = 'kcla_mm/.mim/'
    for config in SHIPPED_CONFIGS:
        assert mim + 'configs/' + config in names
    for metafile in ('detection', 'segmentation'):
        assert f'{mim}configs/{metafile}/metafile.yml' in names
    assert mim + 'model-index.yml' in names
    for tool in USER_TOOLS:
        assert mim + 'tools/' + tool in names
    for tool in DEV_TOOLS:
        assert mim + 'tools/' + tool not in names
    ext, = [n for n in names if re.fullmatch(r'kcla_mm/_ext\..*\.so', n)]
    print(f'{ext}: {sizes[ext]} bytes')
    assert sizes[ext] <= EXT_LIMIT
    assert metadata['Version'] == version()
    release_of_torch = torch.__version__.split('+')[0]
    assert f'torch=={release_of_torch}' in metadata.get_all('Requires-Dist')
    py = f'cp{sys.version_info.major}{sys.version_info.minor}'
    assert tags['Tag'].startswith(f'{py}-{py}-')


def test_sdist_holds_sources_and_mim_files_but_no_tests(release):
    with tarfile.open(release.sdist) as t:
        names = [n.split('/', 1)[1] for n in t.getnames() if '/' in n]
    assert not [n for n in names if n.startswith('tests/')]
    for required in ('setup.py', 'MANIFEST.in', 'README.md',
                     'requirements/runtime.txt', 'requirements/mminstall.txt',
                     'kcla_mm/ops/csrc/pytorch/pybind.cpp',
                     'kcla_mm/.mim/model-index.yml',
                     'kcla_mm/.mim/tools/train.py'):
        assert required in names
    for config in SHIPPED_CONFIGS:
        assert 'kcla_mm/.mim/configs/' + config in names


def test_installed_wheel_imports_with_its_extension_and_no_checkout(
        user_env):
    assert not [p for p in user_env.installed if not p.startswith(
        ('kcla_mm/', f'kcla_mm-{version()}.dist-info/'))]
    assert not osp.exists(osp.join(user_env.site, 'kcla_mm', 'tests'))
    found = json.loads(user_env.run('python', '-c', '''
import importlib.util, json, sys
import kcla_mm, kcla_mm._ext
from kcla_mm.ops import ext_available
print(json.dumps(dict(
    kcla_mm=kcla_mm.__file__, ext=kcla_mm._ext.__file__,
    ext_available=ext_available(), path=sys.path,
    # where these names import from (openmim's model-index ships a
    # top-level `tests` of its own)
    locations={m: list(spec.submodule_search_locations or [spec.origin])
               for m in ('tests', 'tools', 'configs')
               for spec in [importlib.util.find_spec(m)] if spec})))
'''))
    assert found['kcla_mm'].startswith(user_env.site)
    assert found['ext'].startswith(user_env.site)
    assert found['ext_available'] is True
    setup_site = sysconfig.get_paths()['purelib']
    assert not [p for p in found['path'] if p != setup_site and (
        p == ROOT or p.startswith(ROOT + os.sep))]
    for name, places in found['locations'].items():
        assert not [p for p in places if p.startswith(ROOT + os.sep)], name


def test_every_shipped_config_builds_by_name_from_the_wheel(user_env):
    names = [osp.basename(c) for c in SHIPPED_CONFIGS]
    report = json.loads(user_env.run('python', '-c', '''
import importlib, json, sys
from mim.utils import get_installed_path, recursively_find
from mmengine.config import Config
from mmengine.registry import init_default_scope

report = {}
for name in json.loads(sys.argv[1]):
    # mim train/test's lookup: the one file of that name in the package
    found = recursively_find(get_installed_path('kcla_mm'), name,
                             followlinks=True)
    if len(found) != 1:
        report[name] = f'found {found}'
        continue
    try:
        cfg = Config.fromfile(found[0])
        init_default_scope(cfg.default_scope)
        registry = importlib.import_module(cfg.default_scope + '.registry')
        model = registry.MODELS.build(cfg.model)
        report[name] = type(model).__name__
    except Exception as e:
        report[name] = f'{type(e).__name__}: {e}'
print(json.dumps(report))
''', json.dumps(names), timeout=1200).splitlines()[-1])
    failed = {n: r for n, r in report.items() if r not in (
        'FasterRCNN', 'MaskRCNN', 'EncoderDecoder')}
    assert sorted(report) == sorted(names)
    assert not failed


def test_mim_search_lists_the_model_index(user_env):
    listed = user_env.run('mim', 'search', 'kcla_mm')
    for group in ('detection', 'segmentation'):
        with open(osp.join(ROOT, 'configs', group, 'metafile.yml')) as f:
            models = yaml.safe_load(f)['Models']
        for model in models:
            assert f'config id: {model["Name"]}\n' in listed


def lesion_data(user_env) -> None:
    raw = str(user_env.work / 'data' / 'synthetic_isic2018_raw')
    user_env.run('mim', 'run', 'kcla_mm', 'make_synthetic_lesions', raw,
                 '--layout', 'isic2018', '--num-train', '10', '--num-val', '0',
                 '--num-test', '0', '--img-size', '128')
    user_env.run('mim', 'run', 'kcla_mm', 'isic2018', raw,
                 str(user_env.work / 'data' / 'synthetic_isic2018'))


def coco_data(user_env) -> None:
    user_env.run('mim', 'run', 'kcla_mm', 'make_synthetic_coco',
                 str(user_env.work / 'data' / 'synthetic_coco'),
                 '--num-train', '8', '--num-val', '4')


@pytest.mark.parametrize('config, make_data, metric', [
    ('faster-rcnn_r18-kcla_fpn_synthetic-coco.py', coco_data,
     'coco/bbox_mAP'),
    ('res-unet_r18s-kcla_synthetic-isic2018.py', lesion_data,
     'lesion_Dice'),
])
def test_mim_trains_and_tests_a_demo_config_from_the_wheel(
        user_env, config, make_data, metric):
    """The config found by name in the installed package, trained two
    iterations and tested from its checkpoint; data from the wheel's own
    generators (``mim run``), under the folder the configs' data_root is
    relative to."""
    make_data(user_env)
    stem = osp.splitext(config)[0]
    work_dir = str(user_env.work / stem)
    iters = ['train_cfg.max_iters=2', 'train_cfg.val_interval=2',
             'default_hooks.checkpoint.interval=2']
    trained = user_env.run('mim', 'train', 'kcla_mm', config, '--work-dir',
                           work_dir, '--cfg-options', *iters)
    assert osp.join(user_env.mim_root, 'tools', 'train.py') in trained
    checkpoint = osp.join(work_dir, 'iter_2.pth')
    assert osp.isfile(checkpoint)
    tested = user_env.run('mim', 'test', 'kcla_mm', config, '--checkpoint',
                          checkpoint, '--work-dir', work_dir + '_test')
    assert osp.join(user_env.mim_root, 'tools', 'test.py') in tested
    results, = glob.glob(osp.join(work_dir + '_test', '*', '*.json'))
    with open(results) as f:
        assert metric in json.load(f)
