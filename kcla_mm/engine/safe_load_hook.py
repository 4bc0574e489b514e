"""SafeLoadHook: the runner reads its own checkpoints under torch's
weights_only loading."""
import functools

from mmengine.hooks import Hook

from ..utils.safe_load import allow_mmengine_checkpoints


class SafeLoadHook(Hook):
    """Let the runner's ``load_checkpoint`` read mmengine checkpoints with
    ``weights_only=True``.

    mmengine 0.10.7 loads with torch's default, which is
    ``weights_only=True`` from torch 2.6 on, and its own checkpoints hold
    types that torch refuses (the message hub's ``HistoryBuffer``, numpy
    arrays and scalars), so ``--resume``, ``load_from`` and tools/test.py's
    checkpoint fail. Before the run this hook wraps the runner's
    ``load_checkpoint`` (which ``resume`` calls too) so that exactly those
    types are allowed while it runs
    (:func:`~kcla_mm.utils.allow_mmengine_checkpoints`); every other load,
    in the runner or elsewhere in the process, keeps torch's allow-list.
    ``before_run`` precedes the loading in ``train()``, ``val()`` and
    ``test()``. A hook, not a runner class: mmseg's tools/test.py builds
    mmengine's own Runner whatever the config's ``runner_type``. Add it to
    a config with ``custom_hooks = [dict(type='SafeLoadHook')]``.
    """

    priority = 'VERY_HIGH'

    def before_run(self, runner) -> None:
        load = runner.load_checkpoint
        if getattr(load, 'allows_mmengine_checkpoints', False):
            return  # a second run (val() after train()) of the same runner

        @functools.wraps(load)
        def load_checkpoint(*args, **kwargs):
            with allow_mmengine_checkpoints():
                return load(*args, **kwargs)

        load_checkpoint.allows_mmengine_checkpoints = True
        runner.load_checkpoint = load_checkpoint
