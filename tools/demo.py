"""The README's main job: a KCLA detector trained, tested and reloaded on CPU.

1. generates the synthetic COCO-format dataset (if missing);
2. trains Faster R-CNN with a ResNet-18-KCLA backbone through mmdet's own
   ``tools/train.py`` (shipped in the mmdet wheel), which validates at the
   end with pycocotools' COCO evaluation;
3. saves the checkpoint, loads it again through mmdet's own
   ``tools/test.py`` (its ``load_from``) and evaluates again, writing
   pictures of the predicted boxes;
4. prints COCO bbox AP/AP50/AP75/APs/APm/APl before and after the reload,
   and leaves everything under one work directory.

Example:
    .venv/bin/python tools/demo.py --work-dir work_dirs/demo
"""
import argparse
import json
import os.path as osp
import shutil
import sys
import time

from demo_utils import ROOT, latest, make_work_dir, require_at_least, run
from library_tools import wheel_tool

CONFIG = osp.join(ROOT, 'configs', 'demo',
                  'faster-rcnn_r18-kcla_fpn_synthetic-coco.py')
METRICS = ('bbox_mAP', 'bbox_mAP_50', 'bbox_mAP_75', 'bbox_mAP_s',
           'bbox_mAP_m', 'bbox_mAP_l')
NAMES = ('AP', 'AP50', 'AP75', 'APs', 'APm', 'APl')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--work-dir', default=osp.join('work_dirs', 'demo'))
    parser.add_argument('--data-root',
                        default=osp.join('data', 'synthetic_coco'))
    parser.add_argument('--config', default=CONFIG)
    parser.add_argument('--max-iters', type=int, default=None,
                        help='training iterations (default: the config\'s)')
    args = parser.parse_args(argv)
    require_at_least(parser, args, max_iters=1)
    return args


def data_options(data_root: str) -> list:
    root = data_root.rstrip('/') + '/'
    ann = root + 'annotations/instances_val2017.json'
    return [
        f'train_dataloader.dataset.data_root={root}',
        f'val_dataloader.dataset.data_root={root}',
        f'test_dataloader.dataset.data_root={root}',
        f'val_evaluator.ann_file={ann}', f'test_evaluator.ann_file={ann}'
    ]


def train_metrics(work_dir: str) -> dict:
    """The validation metrics logged at the end of training."""
    scalars = latest(osp.join(work_dir, '*', 'vis_data', 'scalars.json'))
    found = {}
    with open(scalars) as f:
        for line in f:
            record = json.loads(line)
            if 'coco/bbox_mAP' in record:
                found = record
    if not found:
        sys.exit(f'error: no COCO metrics in {scalars}')
    return {m: found[f'coco/{m}'] for m in METRICS}


def test_metrics(test_dir: str) -> dict:
    path = latest(osp.join(test_dir, '*', '*.json'))
    with open(path) as f:
        record = json.load(f)
    return {m: record[f'coco/{m}'] for m in METRICS}


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    work_dir = make_work_dir(args.work_dir)
    ann = osp.join(args.data_root, 'annotations', 'instances_train2017.json')
    if not osp.isfile(ann):
        run([sys.executable,
             osp.join(ROOT, 'tools', 'dataset_converters',
                      'make_synthetic_coco.py'), args.data_root])
    options = data_options(osp.abspath(args.data_root))
    if args.max_iters is not None:
        options += [f'train_cfg.max_iters={args.max_iters}',
                    f'train_cfg.val_interval={args.max_iters}',
                    f'default_hooks.checkpoint.interval={args.max_iters}']
    run([sys.executable, wheel_tool('mmdet', 'train.py'),
         args.config, '--work-dir', work_dir, '--cfg-options', *options])
    before = train_metrics(work_dir)
    checkpoint = latest(osp.join(work_dir, 'iter_*.pth'))
    test_dir = osp.join(work_dir, 'reloaded')
    run([sys.executable, wheel_tool('mmdet', 'test.py'),
         args.config, checkpoint,
         '--work-dir', test_dir, '--show-dir', 'predictions',
         '--cfg-options', *options])
    after = test_metrics(test_dir)
    picture = latest(osp.join(test_dir, '*', 'predictions', '*.png'))
    shutil.copy(picture, osp.join(work_dir, 'predictions.png'))
    summary = dict(checkpoint=checkpoint, after_training=before,
                   after_reload=after, seconds=round(time.time() - start))
    with open(osp.join(work_dir, 'demo_metrics.json'), 'w') as f:
        json.dump(summary, f, indent=2)

    print('\nCOCO bbox metrics on the synthetic validation split (pycocotools)')
    print(f'  {"":<16}' + ''.join(f'{n:>8}' for n in NAMES))
    for label, values in (('after training', before),
                          ('after reload', after)):
        print(f'  {label:<16}' +
              ''.join(f'{values[m]:>8.3f}' for m in METRICS))
    same = all(abs(before[m] - after[m]) < 1e-9 for m in METRICS)
    print(f'  reloaded checkpoint gives the same AP: {"yes" if same else "NO"}')
    print(f'\nwork directory: {work_dir}\n  checkpoint      {checkpoint}\n'
          f'  metrics         {osp.join(work_dir, "demo_metrics.json")}\n'
          f'  predictions     {osp.join(work_dir, "predictions.png")}\n'
          f'  logs            {work_dir}/<timestamp>/, {test_dir}/<timestamp>/'
          f'\n  total time      {summary["seconds"]} s')
    if not same:
        sys.exit('error: the reloaded checkpoint gives a different AP')


if __name__ == '__main__':
    main()
