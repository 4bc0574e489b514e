"""TorchRNGStateHook: a resumed run draws the random numbers the
uninterrupted run would have drawn."""
from typing import Optional

import torch
from mmengine.hooks import Hook

CHECKPOINT_KEY = 'torch_rng_state'


class TorchRNGStateHook(Hook):
    """Checkpoint torch's global CPU generator; restore it on resume.

    mmengine 0.10.7's ``Runner.resume`` restores the model, optimizer,
    schedulers, ``iter``/``epoch``, the message hub and the seed, and the
    training loop skips the batches already seen, so a resumed run sees the
    same images with the same augmentation. It does not restore torch's
    global generator, which the training step itself draws from: mmdet's
    RPN and R-CNN ``RandomSampler`` (``torch.randperm``) and the drop-path
    masks of the KCLA branches. Without this hook a resumed run continues
    with other anchors/RoIs and drop-path masks (measured: the demo
    detector's parameters differ by up to 3e-3 after 4 resumed iterations,
    the demo segmentor's by ~1e-3 after 2).

    The generator state goes into every checkpoint (``torch_rng_state``) and
    is put back at the first training iteration after a resume, after the
    batch skipping, so iteration ``iter + 1`` draws from the saved state.
    Only torch's CPU generator is restored: numpy's is already right after
    the skip (data loading with ``num_workers=0``; with worker processes
    the workers' seeds come from the sampler seed and the epoch). Add it to
    a config with ``custom_hooks = [dict(type='TorchRNGStateHook')]``.
    """

    priority = 'VERY_LOW'

    def __init__(self) -> None:
        self._pending: Optional[torch.Tensor] = None

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = torch.get_rng_state()

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._pending = checkpoint.get(CHECKPOINT_KEY)

    def before_train_iter(self, runner, batch_idx: int,
                          data_batch=None) -> None:
        if self._pending is not None:
            torch.set_rng_state(self._pending)
            self._pending = None
