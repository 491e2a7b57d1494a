"""A small byte-level GPT trained with tensor, pipeline and data parallelism, as Colossal-AI's GPT
examples are: the model is written once with nanocolossal.nn layers, the config says how to split.

    torchrun --nproc_per_node 2 train_gpt.py                       # tensor 1d x2 (configs/gpt.py)
    python train_gpt.py --config configs/gpt_single.py             # one process
    torchrun --nproc_per_node 4 train_gpt.py --config configs/gpt_2d.py   # 2d tensor x4
    torchrun --nproc_per_node 8 train_gpt.py --config configs/gpt_2p5d.py # 2.5d: 2 grids of 2x2
    torchrun --nproc_per_node 8 train_gpt.py --config configs/gpt_3d.py   # 3d: a 2x2x2 cube
    torchrun --nproc_per_node 2 train_gpt.py --config configs/gpt_seq.py  # sequence x2 (ring)
    torchrun --nproc_per_node 2 train_gpt.py --config configs/gpt_moe.py  # experts x2 (MoE)

The model: a token embedding split by vocabulary (VocabParallelEmbedding), learned positions,
pre-LayerNorm blocks of causal self-attention (heads split over tensor ranks) and MLP
(nn/transformer.py), a final LayerNorm and a classifier that *is* the token embedding (tied
weights), whose logits stay split by vocabulary into the vocab-parallel cross-entropy. With
parallel.pipeline > 1 the embedding and the classifier sit on the first and last stages and
their gradients are summed between the two (pipeline/tied.py). With NUM_EXPERTS in the config
every other block's MLP is a mixture of experts, spread over parallel.moe ranks (moe/). With
ACTIVATION_CHECKPOINT = 'full' each block recomputes its activations in backward instead of
keeping them (activation_checkpoint.py; 'selective': attention's core only).

Tokens are bytes (vocabulary 256): `--data FILE` (`--download`: tiny Shakespeare), else Python's
standard library source. The log shows the train and validation loss, a greedy sample continuing
a validation prompt, and ends with `final train loss X`: the last step's mean loss over the
global batch, the same (to float tolerance) for one process and every layout under one seed.
"""
import os
from typing import Optional

import torch
from torch import nn

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.context import gpc
from nanocolossal.generate import generate
from nanocolossal.moe.settings import moe_aux_weight, moe_model_settings
from nanocolossal.nn.transformer import Block
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.sequence import token_positions
from nanocolossal.text import VOCAB_SIZE, byte_datasets, load_text
from nanocolossal.trainer import Trainer, hooks

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "gpt.py")


class Embeddings(nn.Module):
    """Token embedding (split by vocabulary) + learned positions."""

    def __init__(self, vocab: int, seq_len: int, dim: int) -> None:
        super().__init__()
        self.seq_len = seq_len  # positions the table holds
        self.tok = col_nn.Embedding(vocab, dim, vocab_parallel=True)
        self.pos = col_nn.Embedding(seq_len, dim, vocab_parallel=False)
        with torch.no_grad():  # GPT-2's std 0.02: the tied classifier's logits start near 0
            self.tok.weight.mul_(0.02)
            self.pos.weight.mul_(0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # 0..s-1, or under sequence parallelism where this rank's tokens sit in the sequence
        return self.tok(ids) + self.pos(token_positions(ids, self.seq_len))


class LMHead(nn.Module):
    """Final LayerNorm, then logits from the token embedding's own table (tied)."""

    def __init__(self, dim: int, vocab: int, embedding: nn.Parameter) -> None:
        super().__init__()
        self.norm = col_nn.LayerNorm(dim)
        self.classifier = col_nn.Classifier(dim, vocab, bias=False, weight=embedding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(x))


def gpt(vocab: int = VOCAB_SIZE, seq_len: int = 64, dim: int = 128, depth: int = 4,
        heads: int = 4, mlp_ratio: int = 4, dropout: float = 0.0,
        moe: Optional[dict] = None, attention: str = "fused") -> nn.Sequential:
    """GPT as a flat Sequential (pipeline-ready): embeddings, `depth` causal blocks, head.
    `moe` (MoeLayer's arguments): every other block's MLP (the 2nd, 4th, ...) is an MoE layer,
    as in GShard and Switch. `attention`: 'fused' or 'explicit' (nn/transformer.py)."""
    col_nn.reset_1d_alternation()
    embeddings = Embeddings(vocab, seq_len, dim)
    blocks = [Block(dim, heads, mlp_ratio, dropout, causal=True, moe=moe if i % 2 else None,
                    attention=attention, index=i) for i in range(depth)]
    return nn.Sequential(embeddings, *blocks, LMHead(dim, vocab, embeddings.tok.weight))


def parse_args():
    parser = nc.get_default_parser()
    parser.set_defaults(config=DEFAULT_CONFIG)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--data", type=str, default=None, help="a text file (bytes are tokens)")
    parser.add_argument("--download", action="store_true", help="fetch tiny Shakespeare to --data")
    parser.add_argument("--max-bytes", type=int, default=300_000, help="text to read at most")
    parser.add_argument("--sample", type=int, default=80, help="bytes to generate at the end")
    parser.add_argument("--checkpoint", type=str, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    return parser.parse_args()


def main():
    # 1. launch with the config: parallel layout, batch, sequence length, model sizes
    args = parse_args()
    nc.launch_from_torch(config=nc.load_config(args.config), backend=args.backend, seed=args.seed,
                         allow_single_process=True)
    logger, cfg = nc.get_dist_logger(), gpc.config

    # 2. the model, cut into this rank's pipeline stage when parallel.pipeline > 1
    moe = moe_model_settings(cfg) if "NUM_EXPERTS" in cfg else None  # MoeLayer's arguments
    model = gpt(seq_len=cfg.SEQ_LEN, dim=cfg.get("DIM", 128), depth=cfg.get("DEPTH", 4),
                heads=cfg.get("HEADS", 4), mlp_ratio=cfg.get("MLP_RATIO", 4),
                dropout=cfg.get("DROPOUT", 0.0), moe=moe)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=cfg.get("NUM_CHUNKS", 1),
                                     partition="uniform", verbose=True)

    # 3. data: byte chunks of SEQ_LEN + 1, sharded over the data-parallel ranks
    text = load_text(args.data, args.download, args.max_bytes)
    train_set, val_set = byte_datasets(text, cfg.SEQ_LEN)
    train_dataloader = nc.get_dataloader(train_set, shuffle=True, seed=args.seed,
                                         batch_size=cfg.BATCH_SIZE, drop_last=True)
    val_dataloader = nc.get_dataloader(val_set, batch_size=cfg.BATCH_SIZE, drop_last=True)

    # 4. initialize: tensor layers are already split; DDP, AMP and the schedule come from the config
    # one fused kernel for the whole update on a GPU, a few foreach ones on a CPU
    kernel = {"fused": True} if gpc.device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, **kernel)
    engine, train_dataloader, val_dataloader, _ = nc.initialize(
        model, optimizer, col_nn.VocabParallelCrossEntropyLoss(), train_dataloader,
        val_dataloader)

    # 5. train, then validate and sample
    trainer = Trainer(engine=engine, logger=logger)
    hook_list = [hooks.LossHook(), hooks.ThroughputHook(), hooks.LogMetricByEpochHook(logger)]
    if args.checkpoint:
        hook_list.append(hooks.SaveCheckpointHook(args.checkpoint,
                                                  every_steps=args.checkpoint_every))
        if args.resume and trainer.resume(args.checkpoint):
            logger.info(f"resumed from {args.checkpoint}: step {trainer.cur_step}")
    last_loss = hooks.LastLossHook()
    trainer.fit(train_dataloader=train_dataloader, epochs=cfg.NUM_EPOCHS,
                test_dataloader=val_dataloader, hooks=hook_list + [last_loss],
                display_progress=True, max_steps=args.max_steps)
    val_loss = trainer.states["metrics"]["test"].get("loss", float("nan"))
    logger.info(f"validation loss {val_loss:.4f}")
    if args.sample:
        prompt = val_set.data[:cfg.SEQ_LEN].tolist()
        copies = cfg.NUM_MICRO_BATCHES if gpc.pipeline_size > 1 else 1
        sample = generate(engine, prompt, args.sample, copies, seed=args.seed)
        logger.info("sample: " + repr(bytes(prompt[-40:]).decode("utf-8", "replace")) + " -> "
                    + repr(bytes(sample).decode("utf-8", "replace")))
    # with MoE layers the training loss is cross-entropy + MOE_AUX_WEIGHT x load-balancing loss
    # (the Engine adds it), in every layout as in one process; validation is cross-entropy alone
    aux = f" (with {moe_aux_weight(cfg):g} x aux loss)" if "NUM_EXPERTS" in cfg else ""
    logger.info(f"final train loss {last_loss.value:.6g}{aux}")
    gpc.destroy()


if __name__ == "__main__":
    main()
