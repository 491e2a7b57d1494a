"""A small Vision Transformer on CIFAR-10, tensor x pipeline x data parallel, with
the config tutorial's parallel settings ("Accelerate your training with colossalai (1)").

    torchrun --nproc_per_node 8 train_tensor.py       # the tutorial: pipeline 2 x tensor 2d 4
    torchrun --nproc_per_node 2 train_tensor.py --config configs/tensor_1d.py   # Megatron 1d x2

The model is written once, with nanocolossal.nn layers: with parallel.tensor they are the 1d
(Megatron), 2d (SUMMA), 2.5d (Tesseract: tensor=dict(size=8, mode='2.5d', depth=2)) or 3d
(tensor=dict(size=8, mode='3d')) layers, without it plain torch layers, and under one seed every
layout starts from the same weights. Attention splits its heads over the tensor ranks (the
qkv projection's output is laid out head by head, so a contiguous slice is whole heads).
The model is an nn.Sequential (patch embedding, blocks, head), so `build_pipeline_model`
cuts it into stages when parallel.pipeline > 1. The run ends with `final train loss X`;
with dropout 0 (the default) and the same global batch, X is the same for every layout.
`--checkpoint F --resume` saves one file per (stage, tensor rank) and continues from them,
mid-epoch too, with the same dropout masks (the sharded dropout's generators are saved).

Without CIFAR-10 on disk (and no --download), a synthetic CIFAR-shaped dataset is used.
"""
import os

import torch
from torch import nn

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.context import gpc
from nanocolossal.metrics import Accuracy
from nanocolossal.nn.transformer import Block
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.trainer import Trainer, hooks

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                              "tensor_vit.py")


class Head(nn.Module):
    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = col_nn.LayerNorm(dim)
        self.classifier = col_nn.Classifier(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(x)[:, 0])  # the class token


def vit(img_size: int = 32, patch_size: int = 4, dim: int = 64, depth: int = 4, heads: int = 4,
        mlp_ratio: int = 2, num_classes: int = 10, dropout: float = 0.0) -> nn.Sequential:
    """ViT as a flat Sequential: patch embedding, `depth` blocks, head (pipeline-ready)."""
    col_nn.reset_1d_alternation()
    return nn.Sequential(col_nn.PatchEmbedding(img_size, patch_size, 3, dim),
                         *[Block(dim, heads, mlp_ratio, dropout, index=i) for i in range(depth)],
                         Head(dim, num_classes))


def parse_args():
    parser = nc.get_default_parser()
    parser.set_defaults(config=DEFAULT_CONFIG)
    parser.add_argument("--epochs", type=int, default=None, help="override NUM_EPOCHS")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="override BATCH_SIZE (per data replica)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1024)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--data", type=str, default=None,
                        help="dataset directory (default $DATA or ./data)")
    parser.add_argument("--download", action="store_true")
    parser.add_argument("--synthetic-size", type=int, default=4096,
                        help="training images in the synthetic stand-in")
    parser.add_argument("--checkpoint", type=str, default=None,
                        help="save here (one file per stage and tensor rank) every epoch")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="also save every N steps")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint when it exists")
    return parser.parse_args()


def main():
    args = parse_args()
    config = nc.load_config(args.config, NUM_EPOCHS=args.epochs, BATCH_SIZE=args.batch_size,
                            debug=args.debug or None)
    nc.launch_from_torch(config=config, backend=args.backend, seed=args.seed,
                         allow_single_process=True)
    logger = nc.get_dist_logger()

    model = vit(dropout=args.dropout)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform", verbose=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_set = nc.data.cifar10(args.data, train=True, download=args.download,
                                synthetic_size=args.synthetic_size)
    test_set = nc.data.cifar10(args.data, train=False, download=args.download,
                               synthetic_size=max(gpc.config.BATCH_SIZE, args.synthetic_size // 4))
    train_dataloader = nc.get_dataloader(train_set, shuffle=True, seed=args.seed,
                                         batch_size=gpc.config.BATCH_SIZE, drop_last=True)
    # every image once
    test_dataloader = nc.get_dataloader(test_set, batch_size=gpc.config.BATCH_SIZE, pad=False)
    engine, train_dataloader, test_dataloader, _ = nc.initialize(
        model, optimizer, col_nn.CrossEntropyLoss(), train_dataloader, test_dataloader
    )
    trainer = Trainer(engine=engine, logger=logger)
    hook_list = [hooks.LossHook(), hooks.AccuracyHook(Accuracy()), hooks.ThroughputHook(),
                 hooks.LogMetricByEpochHook(logger)]
    if args.checkpoint:
        hook_list.append(hooks.SaveCheckpointHook(args.checkpoint,
                                                  every_steps=args.checkpoint_every))
        if args.resume and trainer.resume(args.checkpoint):
            logger.info(f"resumed from {args.checkpoint}: epoch {trainer.cur_epoch + 1}, step "
                        f"{trainer.cur_step}")
    trainer.fit(train_dataloader=train_dataloader, epochs=gpc.config.NUM_EPOCHS,
                test_dataloader=test_dataloader, hooks=hook_list, display_progress=True,
                max_steps=args.max_steps)
    last = trainer.states["metrics"]["train"]
    logger.info(f"final train loss {last['loss']:.6g}, test accuracy "
                f"{trainer.states['metrics']['test'].get('accuracy', float('nan')):.4f}")
    gpc.destroy()


if __name__ == "__main__":
    main()
