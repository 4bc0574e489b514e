"""Build and install kcla_mm and its C++/CUDA extension ``kcla_mm._ext``.

The extension is built as mmcv builds ``mmcv._ext``:

* ``CppExtension`` (CPU kernels) by default;
* ``CUDAExtension`` (CPU + CUDA kernels) when ``torch.cuda.is_available()``
  or ``FORCE_CUDA=1``, for the GPU architectures in ``TORCH_CUDA_ARCH_LIST``
  (e.g. ``"8.0;9.0"``; unset, torch picks the visible GPUs' architectures,
  and without a visible GPU it fails with an IndexError: set the list);
* ``KCLA_WITH_OPS=0`` skips the extension (the pure-PyTorch path is used);
* ``MAX_JOBS`` limits parallel compile jobs (read by torch's ninja builder);
* ``DEBUG=1`` compiles with ``-O0 -g``; otherwise without debug information
  (Python's own CFLAGS carry ``-g``, which makes the library 30x larger).

A wheel with the extension requires the torch it was built against (its
C++ ABI). Build with that torch installed, without build isolation:
``pip wheel --no-build-isolation --no-deps .`` (or ``pip install
--no-build-isolation -e .`` to develop). As in mmdet, configs, the user
tools and the model index go into ``kcla_mm/.mim`` (copies in wheels and
sdists, symlinks in editable installs), where ``mim`` looks for them.
"""
import glob
import os
import os.path as osp
import shutil
import sys

from setuptools import find_packages, setup

ROOT = osp.dirname(osp.abspath(__file__))
CSRC = osp.join('kcla_mm', 'ops', 'csrc')
MIM_FILES = ('configs', 'tools', 'model-index.yml')
# tools that set up or check a development checkout, not for users
DEV_TOOLS = ('setup_env.sh', 'check_cuda_build.sh', 'gpu_check.sh')
WITH_OPS = os.getenv('KCLA_WITH_OPS', '1') != '0'


def readme() -> str:
    with open(osp.join(ROOT, 'README.md'), encoding='utf-8') as f:
        return f.read()


def get_version() -> str:
    scope: dict = {}
    with open(osp.join(ROOT, 'kcla_mm', 'version.py'), encoding='utf-8') as f:
        exec(compile(f.read(), 'version.py', 'exec'), scope)
    return scope['__version__']


def parse_requirements(fname: str) -> list:
    """Requirement lines of ``requirements/<fname>``, comments dropped."""
    with open(osp.join(ROOT, 'requirements', fname), encoding='utf-8') as f:
        lines = (line.split('#', 1)[0].strip() for line in f)
        return [line for line in lines if line]


def import_torch():
    """torch, or exit naming the fix: the extension builds against the
    torch installed next to it, which an isolated build cannot see."""
    try:
        import torch
    except ImportError:
        sys.exit('error: building kcla_mm._ext needs torch installed; '
                 'install the torch it will run with, then build with '
                 '--no-build-isolation (or set KCLA_WITH_OPS=0 for the '
                 'pure-PyTorch package)')
    return torch


def install_requires() -> list:
    """runtime.txt; with the extension, torch pinned to the release it is
    built against (``2.13.0`` also matches local builds such as
    ``2.13.0+cpu``)."""
    requires = parse_requirements('runtime.txt')
    if not WITH_OPS:
        return requires
    release = import_torch().__version__.split('+')[0]
    return [f'torch=={release}' if r.startswith('torch') else r
            for r in requires]


def get_extensions() -> list:
    if not WITH_OPS:
        return []
    torch = import_torch()
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    debug = os.getenv('DEBUG', '0') == '1'
    # reassociation lets the compiler vectorise the kernels' float sums;
    # NaN and infinity semantics are kept (no -ffinite-math-only). -g0
    # comes after (and overrides) the -g of Python's CFLAGS.
    cxx_flags = ['-O0', '-g'] if debug else [
        '-O3', '-fno-math-errno', '-fno-trapping-math', '-fno-signed-zeros',
        '-fassociative-math', '-g0'
    ]
    # at::parallel_for is header code that runs serially unless compiled
    # with OpenMP (the libgomp torch already loaded serves it)
    cxx_flags.append('-fopenmp')
    link_flags = ['-fopenmp']
    sources = glob.glob(osp.join(CSRC, 'pytorch', '*.cpp')) + glob.glob(
        osp.join(CSRC, 'pytorch', 'cpu', '*.cpp'))
    include_dirs = [osp.join(ROOT, CSRC, 'common')]
    with_cuda = torch.cuda.is_available() or os.getenv('FORCE_CUDA', '0') == '1'
    if with_cuda:
        sources += glob.glob(osp.join(CSRC, 'pytorch', 'cuda', '*.cpp'))
        sources += glob.glob(osp.join(CSRC, 'pytorch', 'cuda', '*.cu'))
        include_dirs.append(osp.join(ROOT, CSRC, 'common', 'cuda'))
        return [
            CUDAExtension(
                name='kcla_mm._ext',
                sources=sorted(sources),
                include_dirs=include_dirs,
                extra_link_args=link_flags,
                extra_compile_args={
                    'cxx': cxx_flags,
                    'nvcc': ['-O0' if debug else '-O3',
                             '--expt-relaxed-constexpr'],
                })
        ]
    return [
        CppExtension(
            name='kcla_mm._ext',
            sources=sorted(sources),
            include_dirs=include_dirs,
            extra_link_args=link_flags,
            extra_compile_args={'cxx': cxx_flags})
    ]


def get_cmdclass() -> dict:
    if not WITH_OPS:
        return {}
    from torch.utils.cpp_extension import BuildExtension
    return {'build_ext': BuildExtension}


def add_mim_extension() -> None:
    """Put configs, user tools and the model index under ``kcla_mm/.mim``:
    copies for a wheel or sdist, symlinks for an editable install (as
    mmdet's setup.py). Building from an sdist keeps the copies it holds."""
    if {'develop', 'editable_wheel'} & set(sys.argv):
        mode = 'symlink'
    elif {'sdist', 'bdist_wheel'} & set(sys.argv):
        mode = 'copy'
    else:
        return
    mim_path = osp.join(ROOT, 'kcla_mm', '.mim')
    for name in MIM_FILES:
        src = osp.join(ROOT, name)
        if not osp.exists(src):
            continue
        os.makedirs(mim_path, exist_ok=True)
        dst = osp.join(mim_path, name)
        if osp.islink(dst) or osp.isfile(dst):
            os.remove(dst)
        elif osp.isdir(dst):
            shutil.rmtree(dst)
        if mode == 'symlink':
            os.symlink(osp.relpath(src, mim_path), dst)
        elif osp.isdir(src):
            shutil.copytree(
                src, dst,
                ignore=shutil.ignore_patterns('__pycache__', *DEV_TOOLS))
        else:
            shutil.copyfile(src, dst)


if __name__ == '__main__':
    add_mim_extension()
    setup(
        name='kcla_mm',
        version=get_version(),
        description='Key-Correlated Layer Attention (KCLA) for OpenMMLab '
        '(mmdet 3.3 / mmsegmentation 1.2)',
        long_description=readme(),
        long_description_content_type='text/markdown',
        author='kcla_mm contributors',
        license='Apache License 2.0',
        keywords='layer attention, computer vision, object detection, '
        'semantic segmentation, openmmlab',
        classifiers=[
            'Development Status :: 4 - Beta',
            'Operating System :: POSIX :: Linux',
            'Programming Language :: C++',
            'Programming Language :: Python :: 3',
            'Programming Language :: Python :: 3.11',
            'Topic :: Scientific/Engineering :: Artificial Intelligence',
        ],
        python_requires='>=3.8',
        packages=find_packages(include=('kcla_mm', 'kcla_mm.*')),
        include_package_data=True,
        install_requires=install_requires(),
        extras_require={
            'mim': parse_requirements('mminstall.txt'),
            'tests': parse_requirements('tests.txt'),
            'build': parse_requirements('build.txt'),
        },
        ext_modules=get_extensions(),
        cmdclass=get_cmdclass(),
        zip_safe=False,
    )
