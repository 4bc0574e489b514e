"""The segmentation demo: a KCLA ResNet-UNet trained, tested and shown on CPU.

1. generates synthetic skin-lesion images in the raw layout of the official
   ISIC 2018 download (``make_synthetic_lesions.py``) and converts them with
   the ISIC 2018 converter (seeded 70/10/20 split), if missing;
2. trains the ResNet-UNet with a KCLA encoder through mmseg's own
   ``tools/train.py`` (config
   ``configs/demo/res-unet_r18s-kcla_synthetic-isic2018.py``), which
   validates at the end with ``LesionMetric``;
3. reloads the checkpoint with mmseg's own ``tools/test.py`` on the test
   split;
4. prints lesion IoU / Dice (dataset-level and per-image mean) and mmseg's
   mIoU / mDice, and writes ``predictions.png``: image | ground truth |
   prediction for a few test images, all under one work directory.

Example:
    .venv/bin/python tools/seg_demo.py --work-dir work_dirs/seg_demo
"""
import argparse
import glob
import json
import os.path as osp
import sys
import time

import numpy as np
from PIL import Image

from demo_utils import ROOT, latest, make_work_dir, require_at_least, run
from library_tools import wheel_tool

CONFIG = osp.join(ROOT, 'configs', 'demo',
                  'res-unet_r18s-kcla_synthetic-isic2018.py')
CONVERTERS = osp.join(ROOT, 'tools', 'dataset_converters')
METRICS = ('lesion_IoU', 'lesion_Dice', 'mean_image_IoU', 'mean_image_Dice',
           'mIoU', 'mDice')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--work-dir',
                        default=osp.join('work_dirs', 'seg_demo'))
    parser.add_argument('--data-root',
                        default=osp.join('data', 'synthetic_isic2018'))
    parser.add_argument('--num-images', type=int, default=200,
                        help='synthetic images to generate (split 70/10/20)')
    parser.add_argument('--config', default=CONFIG)
    parser.add_argument('--max-iters', type=int, default=None,
                        help="training iterations (default: the config's)")
    parser.add_argument('--num-shown', type=int, default=4,
                        help='test images in predictions.png')
    args = parser.parse_args(argv)
    require_at_least(parser, args, num_images=1, max_iters=1, num_shown=1)
    return args


def prepare_data(data_root: str, num_images: int) -> None:
    """Synthetic raw ISIC 2018 download -> mmseg layout (skipped if there)."""
    if osp.isdir(osp.join(data_root, 'img_dir', 'train')):
        return
    raw = data_root.rstrip('/') + '_raw'
    if not osp.isdir(raw):
        run([sys.executable, osp.join(CONVERTERS, 'make_synthetic_lesions.py'),
             raw, '--layout', 'isic2018', '--num-train', str(num_images),
             '--num-val', '0', '--num-test', '0', '--img-size', '128'])
    run([sys.executable, osp.join(CONVERTERS, 'isic2018.py'), raw, data_root])


def data_options(data_root: str) -> list:
    root = data_root.rstrip('/') + '/'
    return [f'{split}_dataloader.dataset.data_root={root}'
            for split in ('train', 'val', 'test')]


def train_metrics(work_dir: str) -> dict:
    """The validation metrics logged at the end of training."""
    scalars = latest(osp.join(work_dir, '*', 'vis_data', 'scalars.json'))
    found = {}
    with open(scalars) as f:
        for line in f:
            record = json.loads(line)
            if 'lesion_Dice' in record:
                found = record
    if not found:
        sys.exit(f'error: no lesion metrics in {scalars}')
    return {m: found[m] for m in METRICS}


def test_metrics(test_dir: str) -> dict:
    with open(latest(osp.join(test_dir, '*', '*.json'))) as f:
        record = json.load(f)
    return {m: record[m] for m in METRICS}


def write_predictions(config: str, checkpoint: str, data_root: str,
                      num_shown: int, out_file: str) -> None:
    """Rows of image | ground truth | prediction for the first test images."""
    from mmseg.apis import inference_model, init_model

    from kcla_mm.utils import allow_mmengine_checkpoints
    with allow_mmengine_checkpoints():  # a runner checkpoint of this demo
        model = init_model(config, checkpoint, device='cpu')
    images = sorted(glob.glob(osp.join(data_root, 'img_dir', 'test',
                                       '*.jpg')))[:num_shown]
    rows = []
    for path in images:
        stem = osp.splitext(osp.basename(path))[0]
        image = np.asarray(Image.open(path).convert('RGB'))
        gt = np.asarray(Image.open(
            osp.join(data_root, 'ann_dir', 'test', stem + '.png')))
        pred = inference_model(model, path).pred_sem_seg.data[0].numpy()
        masks = [np.repeat((m > 0)[..., None] * 255, 3, 2).astype(np.uint8)
                 for m in (gt, pred)]
        rows.append(np.concatenate([image] + masks, axis=1))
    Image.fromarray(np.concatenate(rows, axis=0)).save(out_file)


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    work_dir = make_work_dir(args.work_dir)
    data_root = osp.abspath(args.data_root)
    prepare_data(data_root, args.num_images)
    options = data_options(data_root)
    if args.max_iters is not None:
        options += [f'train_cfg.max_iters={args.max_iters}',
                    f'train_cfg.val_interval={args.max_iters}',
                    f'default_hooks.checkpoint.interval={args.max_iters}',
                    f'param_scheduler.0.end={args.max_iters}',
                    f'param_scheduler.0.T_max={args.max_iters}']
    run([sys.executable, wheel_tool('mmseg', 'train.py'),
         args.config, '--work-dir', work_dir, '--cfg-options', *options])
    before = train_metrics(work_dir)
    checkpoint = latest(osp.join(work_dir, 'iter_*.pth'))
    test_dir = osp.join(work_dir, 'test')
    run([sys.executable, wheel_tool('mmseg', 'test.py'),
         args.config, checkpoint,
         '--work-dir', test_dir, '--cfg-options', *options])
    after = test_metrics(test_dir)
    picture = osp.join(work_dir, 'predictions.png')
    write_predictions(args.config, checkpoint, data_root, args.num_shown,
                      picture)
    summary = dict(checkpoint=checkpoint, val_after_training=before,
                   test_after_reload=after,
                   seconds=round(time.time() - start))
    with open(osp.join(work_dir, 'seg_demo_metrics.json'), 'w') as f:
        json.dump(summary, f, indent=2)

    print('\nLesion segmentation metrics (%) on the synthetic ISIC 2018 '
          'splits')
    print(f'  {"":<22}' + ''.join(f'{m:>16}' for m in METRICS))
    for label, values in (('val, after training', before),
                          ('test, reloaded', after)):
        print(f'  {label:<22}' + ''.join(f'{values[m]:>16.2f}'
                                          for m in METRICS))
    print(f'\nwork directory: {work_dir}\n  checkpoint      {checkpoint}\n'
          f'  metrics         {osp.join(work_dir, "seg_demo_metrics.json")}\n'
          f'  predictions     {picture} (image | ground truth | prediction)\n'
          f'  logs            {work_dir}/<timestamp>/, {test_dir}/<timestamp>/'
          f'\n  total time      {summary["seconds"]} s')


if __name__ == '__main__':
    main()
