"""ResNet-50 on CIFAR-10 in a 2-stage pipeline, as in Colossal-AI's pipeline tutorial
("Train ResNet on CIFAR-10 with pipeline parallelism"): main() is that tutorial's train().

    torchrun --nproc_per_node 2 train_pipeline.py             # 2 stages, 4 micro-batches, 1F1B
    torchrun --nproc_per_node 2 train_pipeline.py --chunks 2  # interleaved 1F1B, 2 chunks a rank
    torchrun --nproc_per_node 2 train_pipeline.py --schedule gpipe --trace trace.json
    torchrun --nproc_per_node 4 train_pipeline.py             # 2 stages x 2 data-parallel replicas

The config file (--config, default configs/pipeline_resnet50.py) holds the tutorial's keys:
BATCH_SIZE, NUM_EPOCHS, NUM_MICRO_BATCHES, NUM_CHUNKS and parallel=dict(pipeline=2), and MODEL;
the flags --epochs, --batch-size, --micro-batches, --chunks, --pipeline, --schedule and --model
override them.
The model is written as one nn.Sequential (stem, the 16 bottleneck blocks, classifier) so that
`build_pipeline_model` can cut it; each rank builds the whole model with the same seed and
keeps its part. `nc.initialize` reads NUM_MICRO_BATCHES / NUM_CHUNKS / PIPELINE_SCHEDULE from
the config and the Trainer runs every batch through the schedule: loss on every stage,
accuracy from the last. `--trace FILE` writes the real per-rank timings of a few training
iterations as a Chrome/Perfetto trace (open it at ui.perfetto.dev or chrome://tracing).
`--checkpoint F --checkpoint-every N --resume` makes a job that `torchrun --max-restarts 1`
restarts after a crash continue from its last checkpoint, mid-epoch, bit-identically.

Without CIFAR-10 on disk (and no --download), a synthetic CIFAR-shaped dataset is used.
"""
import os
import time

import torch
import torch.nn as nn
from torchvision.models.resnet import BasicBlock, Bottleneck, conv1x1

import nanocolossal as nc
from nanocolossal.context import gpc
from nanocolossal.metrics import Accuracy
from nanocolossal.nn.lr_scheduler import LinearWarmupLR
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.pipeline.plan import SCHEDULES
from nanocolossal.trainer import Trainer, hooks
from nanocolossal.utils import MultiTimer


class ResNetClassifier(nn.Module):
    def __init__(self, expansion: int, num_classes: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * expansion, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.avgpool(x), 1))


# name -> (residual block, blocks per stage); 18 is a quick smoke-test size, 50 the tutorial's
RESNETS = {"resnet18": (BasicBlock, [2, 2, 2, 2]), "resnet50": (Bottleneck, [3, 4, 6, 3])}


def resnet(name: str = "resnet50", num_classes: int = 10) -> nn.Sequential:
    """The tutorial's ResNet-50 (or ResNet-18), with the residual stages flattened into their
    blocks: 18 layers instead of 6 for ResNet-50, so the pipeline can cut between any two blocks."""
    if name not in RESNETS:
        raise ValueError(f"[rank {gpc.rank}] MODEL must be one of {sorted(RESNETS)}, got {name!r}")
    block, counts = RESNETS[name]
    inplanes, blocks = 64, []
    stem = nn.Sequential(nn.Conv2d(3, inplanes, kernel_size=7, stride=2, padding=3, bias=False),
                         nn.BatchNorm2d(inplanes), nn.ReLU(inplace=True),
                         nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
    for planes, count, stride in zip([64, 128, 256, 512], counts, [1, 2, 2, 2]):
        for i in range(count):
            downsample = None
            if i == 0 and (stride != 1 or inplanes != planes * block.expansion):
                downsample = nn.Sequential(conv1x1(inplanes, planes * block.expansion, stride),
                                           nn.BatchNorm2d(planes * block.expansion))
            blocks.append(block(inplanes, planes, stride if i == 0 else 1, downsample))
            inplanes = planes * block.expansion
    model = nn.Sequential(stem, *blocks, ResNetClassifier(block.expansion, num_classes))
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
    return model


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                              "pipeline_resnet50.py")


def parse_args(argv=None):
    parser = nc.get_default_parser()
    parser.set_defaults(config=DEFAULT_CONFIG)
    parser.add_argument("--epochs", type=int, default=None, help="override NUM_EPOCHS")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="override BATCH_SIZE (per data replica)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="override NUM_MICRO_BATCHES")
    parser.add_argument("--pipeline", type=int, default=None,
                        help="override parallel.pipeline (stages)")
    parser.add_argument("--chunks", type=int, default=None,
                        help="override NUM_CHUNKS (> 1: interleaved 1F1B)")
    parser.add_argument("--schedule", choices=SCHEDULES, default=None,
                        help="override PIPELINE_SCHEDULE")
    parser.add_argument("--model", choices=sorted(RESNETS), default=None, help="override MODEL")
    parser.add_argument("--partition", default="profile",
                        help="profile, parameters, uniform or counts like 5,13")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--data", type=str, default=None,
                        help="dataset directory (default $DATA or ./data)")
    parser.add_argument("--download", action="store_true")
    parser.add_argument("--synthetic-size", type=int, default=1536,
                        help="training images in the synthetic stand-in")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--trace", type=str, default=None,
                        help="write a Chrome/Perfetto trace of the schedule here")
    parser.add_argument("--checkpoint", type=str, default=None,
                        help="save here (one file per stage) every epoch")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="also save every N steps")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint when it exists")
    return parser.parse_args(argv)


def build_config(args):
    """The config file's keys, overridden by the flags given. `--schedule zbv` without --chunks
    runs two chunks a rank, the V (as `python -m nanocolossal.pipeline --show` assumes): the
    file's NUM_CHUNKS is for its own schedule. A --chunks given is kept, and a wrong one refused
    when the schedule is planned."""
    chunks = 2 if args.schedule == "zbv" and args.chunks is None else args.chunks
    return nc.load_config(args.config, NUM_EPOCHS=args.epochs, BATCH_SIZE=args.batch_size,
                          NUM_MICRO_BATCHES=args.micro_batches, NUM_CHUNKS=chunks,
                          PIPELINE_SCHEDULE=args.schedule, MODEL=args.model,
                          parallel=dict(pipeline=args.pipeline), debug=args.debug or None)


def build_cifar(args, batch_size: int):
    """CIFAR-10 from --data (or a synthetic stand-in). Training drops a last batch so small that
    BatchNorm would see one-sample micro-batches; the test loader keeps every image (uneven
    micro-batches are weighted exactly) and pads none (pad=False: each image counted once)."""
    train_set = nc.data.cifar10(args.data, train=True, download=args.download,
                                synthetic_size=args.synthetic_size)
    test_set = nc.data.cifar10(args.data, train=False, download=args.download,
                               synthetic_size=max(batch_size, args.synthetic_size // 3))
    return (nc.get_dataloader(train_set, shuffle=True, batch_size=batch_size, drop_last=True),
            nc.get_dataloader(test_set, batch_size=batch_size, pad=False))


def main():
    # 1. launch: the config file's keys, some overridden by flags
    args = parse_args()
    nc.launch_from_torch(config=build_config(args), backend=args.backend,
                         allow_single_process=True)
    logger = nc.get_dist_logger()
    cfg = gpc.config

    # 2. build the model as one nn.Sequential; this rank keeps its stage (or its chunks)
    partition = args.partition
    if "," in partition:  # layer counts per part, e.g. 5,13
        partition = [int(n) for n in partition.split(",")]
    sample = torch.randn(cfg.BATCH_SIZE // cfg.NUM_MICRO_BATCHES, 3, 32, 32)  # for "profile"
    model = build_pipeline_model(resnet(cfg.get("MODEL", "resnet50")),
                                 num_chunks=cfg.get("NUM_CHUNKS", 1), partition=partition,
                                 verbose=True, sample_input=sample)

    # 3. criterion, optimizer, data, learning-rate schedule
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_dataloader, test_dataloader = build_cifar(args, cfg.BATCH_SIZE)
    lr_scheduler = LinearWarmupLR(optimizer, cfg.NUM_EPOCHS, warmup_steps=args.warmup_epochs)

    # 4. initialize: the schedule from NUM_MICRO_BATCHES, NUM_CHUNKS (and PIPELINE_SCHEDULE)
    engine, train_dataloader, test_dataloader, lr_scheduler = nc.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader, lr_scheduler)

    # 5. train: the Trainer runs every batch through the schedule; hooks add the rest
    trainer = Trainer(engine=engine, timer=MultiTimer(), logger=logger)
    hook_list = [hooks.LossHook(), hooks.AccuracyHook(Accuracy()), hooks.ThroughputHook(),
                 hooks.LogMetricByEpochHook(logger),
                 hooks.LRSchedulerHook(lr_scheduler, by_epoch=True)]
    if args.trace and isinstance(engine, nc.PipelineEngine):
        hook_list.append(hooks.PipelineTraceHook(args.trace))
    if args.checkpoint:
        hook_list.append(hooks.SaveCheckpointHook(args.checkpoint, lr_scheduler=lr_scheduler,
                                                  every_steps=args.checkpoint_every))
        if args.resume and trainer.resume(args.checkpoint, lr_scheduler):
            logger.info(f"resumed from {args.checkpoint}: epoch {trainer.cur_epoch + 1}, step "
                        f"{trainer.cur_step}")
    start = time.perf_counter()
    trainer.fit(train_dataloader=train_dataloader, epochs=cfg.NUM_EPOCHS,
                test_dataloader=test_dataloader, test_interval=1, hooks=hook_list,
                display_progress=True, max_steps=args.max_steps)
    metrics = trainer.states["metrics"]
    logger.info(f"done in {time.perf_counter() - start:.0f} s: final train loss "
                f"{metrics['train']['loss']:.4f}, test accuracy "
                f"{metrics['test'].get('accuracy', float('nan')):.4f}")
    gpc.destroy()


if __name__ == "__main__":
    main()
