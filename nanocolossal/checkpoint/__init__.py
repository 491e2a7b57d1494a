"""Checkpoints that survive crashes and load anywhere.

What a checkpoint holds: the model (keys exactly the plain model's), the optimizer (with the AMP
loss scaler and fp32 master weights: amp.py; ZeRO's shards: zero.py), the LR scheduler, where
training is (epoch, step, batch in epoch: progress.py's Progress, which resumes mid-epoch), and
the RNG states of every rank of the gradient group (tensor-parallel dropout's own generators
too), so a resumed run draws the same random numbers as one that never stopped.

Who writes: data-parallel rank 0 of each (pipeline stage, tensor rank), one file each
(`ckpt.pt` -> `ckpt-stage0.pt`, `ckpt-stage1.pt` when pipeline > 1; `ckpt-stage0-tensor1.pt`
with tensor parallelism; `-expert{e}` from each rank e of the first expert-parallel group with
parallel.moe: each holds other experts). Replicas are identical, so one copy suffices; under
ZeRO their optimizer states are shards, so every data rank r writes its segments beside its
stage's file (`ckpt-zero{r}.pt`; level 3: its parameters' too). Each file is written to
`ckpt.pt.tmp-PID`, fsynced and renamed over `ckpt.pt`: a crash leaves the old file or the new
one, whole. Stage files are not renamed at once, so every save has one id, recorded in each
file, and a set mixed from two saves is refused with each file's step.

    save    save_checkpoint: every rank its file(s); a barrier until all exist  (save_load.py)
    load    load_checkpoint: into the layout that wrote the files -- pipeline size and cut
            (PIPELINE_SCHEDULE, NUM_CHUNKS, partition), tensor mode and size; another layout
            is refused naming both and the way across; a ZeRO rank reads only the files
            holding its own segments (zero.py)
    merge   merge_checkpoint(path), offline: any layout's files -> the plain model's
            state_dict, which load_plain_state_dict cuts into any layout (merge.py)

Keys lose `module.` (DDP), `model.` (wrappers) and `_orig_mod.` (torch.compile) prefixes;
files are read without running code from them (files.py; `trusted=True` for one you trust).
"""
from .files import PathLike, UnsafeCheckpointError, read_file, strip_prefixes, unwrap  # noqa: F401
from .merge import (  # noqa: F401
    load_optimizer_state,
    load_plain_state_dict,
    merge_checkpoint,
    merge_pipeline_checkpoint,
    merge_tensor_parallel,
    tensor_splits_of,
)
from .progress import Progress  # noqa: F401
from .save_load import atomic_save, load_checkpoint, save_checkpoint, stage_path  # noqa: F401
