"""mmdet's and mmseg's own tools (their wheels ship them under
``.mim/tools``), picked for a kcla_mm config and run with its arguments."""
import importlib
import os.path as osp
import runpy
import sys

# the default_scopes of kcla_mm's configs, each the package whose tools
# run such a config
LIBRARIES = ('mmdet', 'mmseg')


def wheel_tool(package: str, name: str) -> str:
    """Path of ``package``'s own tools/<name>; exits if it is missing."""
    module = importlib.import_module(package)
    path = osp.join(osp.dirname(module.__file__), '.mim', 'tools', name)
    if not osp.isfile(path):
        sys.exit(f'error: {path} not found; is {package} installed from its '
                 'wheel?')
    return path


def config_library(config: str) -> str:
    """``'mmdet'`` or ``'mmseg'``: the ``default_scope`` of ``config``;
    exits naming the config if it is missing or has another scope."""
    if not osp.isfile(config):
        sys.exit(f'error: config file {config} not found')
    from mmengine.config import Config
    scope = Config.fromfile(
        config, import_custom_modules=False).get('default_scope')
    if scope not in LIBRARIES:
        sys.exit(f'error: {config} has default_scope={scope!r}; kcla_mm '
                 f'runs configs of {" or ".join(LIBRARIES)}')
    return scope


def run_library_tool(name: str, doc: str) -> None:
    """Run ``tools/<name>`` of the config's library in this process, with
    this script's command line (the config first)."""
    args = sys.argv[1:]
    if not args or args[0] in ('-h', '--help'):
        print(doc)
        sys.exit(0 if args else 2)
    tool = wheel_tool(config_library(args[0]), name)
    # `--launcher pytorch` on a machine without a GPU: mmengine's launcher
    # starts with gloo (patched in this process only)
    from kcla_mm.utils import enable_cpu_distributed
    enable_cpu_distributed()
    sys.argv = [tool] + args
    runpy.run_path(tool, run_name='__main__')
