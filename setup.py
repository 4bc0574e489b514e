"""Build and install kcla_mm and its C++/CUDA extension ``kcla_mm._ext``.

The extension is built as mmcv builds ``mmcv._ext``:

* ``CppExtension`` (CPU kernels) by default;
* ``CUDAExtension`` (CPU + CUDA kernels) when ``torch.cuda.is_available()``
  or ``FORCE_CUDA=1``; set ``TORCH_CUDA_ARCH_LIST`` to choose GPU archs;
* ``KCLA_WITH_OPS=0`` skips the extension (the pure-PyTorch path is used);
* ``MAX_JOBS`` limits parallel compile jobs (read by torch's ninja builder);
* ``DEBUG=1`` compiles with ``-O0 -g``.

Build with the target torch already installed:
``pip install --no-build-isolation -e .``
"""
import glob
import os
import os.path as osp

from setuptools import find_packages, setup

ROOT = osp.dirname(osp.abspath(__file__))
CSRC = osp.join('kcla_mm', 'ops', 'csrc')


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


def get_extensions() -> list:
    if os.getenv('KCLA_WITH_OPS', '1') == '0':
        return []
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    debug = os.getenv('DEBUG', '0') == '1'
    # reassociation lets the compiler vectorise the kernels' float sums;
    # NaN and infinity semantics are kept (no -ffinite-math-only)
    cxx_flags = ['-O0', '-g'] if debug else [
        '-O3', '-fno-math-errno', '-fno-trapping-math', '-fno-signed-zeros',
        '-fassociative-math'
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
    if os.getenv('KCLA_WITH_OPS', '1') == '0':
        return {}
    from torch.utils.cpp_extension import BuildExtension
    return {'build_ext': BuildExtension}


setup(
    name='kcla_mm',
    version=get_version(),
    description='Key-Correlated Layer Attention (KCLA) for OpenMMLab '
    '(mmdet 3.3 / mmsegmentation 1.2)',
    long_description=readme(),
    long_description_content_type='text/markdown',
    license='Apache License 2.0',
    python_requires='>=3.8',
    packages=find_packages(exclude=('configs', 'tools', 'tests')),
    include_package_data=True,
    package_data={'kcla_mm.ops': ['csrc/**/*']},
    install_requires=parse_requirements('runtime.txt'),
    extras_require={
        'mim': parse_requirements('mminstall.txt'),
        'tests': parse_requirements('tests.txt'),
        'build': parse_requirements('build.txt'),
    },
    ext_modules=get_extensions(),
    cmdclass=get_cmdclass(),
    zip_safe=False,
)
