"""Planted bugs: one plausible mistake each, in the library's algorithms, and the tests that must
catch it (run.py plants them one at a time in a copy of the repository; docs/testing.md has the
table of what caught each).

Each entry: `id`; `idea` (the feature); `file`; `old`, an exact snippet found once in that file,
and `new`, the same with the bug (a one-line change; `old` may span a line more to be unique);
`bug`, the mistake in words; `tests`, pytest arguments (files, node ids, or a file and -k).
Not collected by pytest (no test_*.py name, and tests/mutations is no test folder of its own).
"""
from __future__ import annotations

MUTATIONS: list[dict] = [
    # -- data parallelism ------------------------------------------------------------------------
    dict(id="ddp-sum-not-mean", idea="DDP", file="nanocolossal/ddp.py",
         old="        torch.div(bucket.params[i].grad, self.world_size, out=bucket.view(i))",
         new="        bucket.view(i).copy_(bucket.params[i].grad)",
         bug="a gradient is written into its bucket without dividing by the world size: the "
             "all-reduce sums instead of averaging (a wrong scale)",
         tests=["tests/test_ddp.py::test_gloo_ddp_on_two_ranks_equals_one_process",
                "tests/test_ddp.py::test_deep_ddp_equals_torch_ddp_and_one_process"]),
    dict(id="ddp-drop-accumulated-grad", idea="DDP x accumulation", file="nanocolossal/ddp.py",
         old="            bucket.view(i).zero_()\n        else:\n"
             "            self._write_slot(bucket, i)",
         new="            bucket.view(i).zero_()\n        else:\n"
             "            bucket.view(i).zero_()",
         bug="a parameter the last micro-step did not use sends zeros, dropping the gradient it "
             "accumulated under no_sync in earlier micro-steps",
         tests=["tests/test_ddp.py", "-k", "last_micro_step_skips"]),
    dict(id="grad-handler-sum-not-mean", idea="gradient handler",
         file="nanocolossal/gradient_handler.py",
         old="flat = torch.cat([_flatten_dense_tensors(grads) / divisor, had])",
         new="flat = torch.cat([_flatten_dense_tensors(grads), had])",
         bug="the after-backward gradient handler all-reduces gradients without dividing by the "
             "group size (a sum, not the mean)",
         tests=["tests/test_engine.py::test_gloo_gradient_handler_equals_one_process_with_"
                "accumulation_and_clipping"]),
    # -- SyncBN ----------------------------------------------------------------------------------
    dict(id="syncbn-backward-local-sums", idea="SyncBN", file="nanocolossal/syncbn.py",
         old="            dist.all_reduce(sums, group=ctx.group)",
         new="            pass  # (the all-reduce of the backward's sums, dropped)",
         bug="backward forgets the all-reduce of sum_dy and sum_dy_xmu: each rank's input "
             "gradient uses its own samples' sums over the global count",
         tests=["tests/test_syncbn.py"]),
    dict(id="syncbn-biased-running-var", idea="SyncBN", file="nanocolossal/syncbn.py",
         old="unbiased = var * total / (total - 1).clamp(min=1)",
         new="unbiased = var",
         bug="running_var is updated with the biased batch variance (no N / (N - 1))",
         tests=["tests/test_syncbn.py"]),
    dict(id="syncbn-naive-statistics", idea="SyncBN", file="nanocolossal/syncbn.py",
         old="        mean, var, total = statistics(xf, group)",
         new="        mean, var, total = naive_statistics(xf, group)",
         bug="the forward takes the textbook's S2 / N - mu^2 in fp32, which cancels when the "
             "mean is large next to the spread",
         tests=["tests/test_syncbn.py"]),
    # -- AMP -------------------------------------------------------------------------------------
    dict(id="amp-skipped-unscale", idea="AMP", file="nanocolossal/amp.py",
         old="        return unscale_grads(grads, self.backward_scale)",
         new="        return unscale_grads(grads, 1.0)",
         bug="the gradients are checked for inf/NaN but not unscaled: the optimizer steps with "
             "gradients S times too large",
         tests=["tests/test_amp.py", "-k", "not gloo"]),
    dict(id="amp-overflow-not-agreed", idea="AMP", file="nanocolossal/amp.py",
         old="            dist.all_reduce(found, op=dist.ReduceOp.MAX)",
         new="            pass  # (the all-reduce of the overflow flag, dropped)",
         bug="an inf/NaN found on one rank is not all-reduced: that rank skips the step, the "
             "others take it, and the replicas diverge",
         tests=["tests/test_engine.py::test_gloo_engine_overflow_on_one_rank_skips_on_all"]),
    dict(id="amp-overflow-agreed-over-data-only", idea="AMP x sequence / pipeline",
         file="nanocolossal/amp.py",
         old="            dist.all_reduce(found, op=dist.ReduceOp.MAX)",
         new="            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=gpc.data_group)",
         bug="the overflow flag is agreed among the data ranks only: a sequence or pipeline rank "
             "whose gradients overflowed skips the step while the others of its replica take it",
         tests=["tests/test_composition.py", "-k", "table and overflow"]),
    dict(id="offload-check-not-unscaled", idea="ZeRO offload", file="nanocolossal/zero/mixed.py",
         old="        found = unscale_grads([v.grad for v, _ in pairs], self.backward_scale)",
         new="        found = unscale_grads([v.grad for v, _ in pairs], 1.0)",
         bug="offload checks the fp32 gradients on the device but forgets to unscale them: under "
             "fp16 O1 the CPU's optimizer steps with gradients S times too large",
         tests=["tests/test_zero_offload.py", "-k", "device"]),
    dict(id="scaler-hysteresis-off-by-one", idea="AMP loss scaler",
         file="nanocolossal/amp_scaler.py",
         old="            if self.hysteresis_tracker <= 0:",
         new="            if self.hysteresis_tracker < 0:",
         bug="the scaler backs off one overflow later than its hysteresis allows (off by one)",
         tests=["tests/test_amp.py", "-k", "scaler and not gloo"]),
    dict(id="clip-scales-up", idea="clip", file="nanocolossal/clip.py",
         old="coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)",
         new="coef = max_norm / (norm + 1e-6)",
         bug="the clip coefficient is not capped at 1: gradients smaller than max_norm are "
             "scaled up to it",
         tests=["tests/test_amp.py", "-k", "clip and not gloo"]),
    dict(id="clip-split-part-not-summed", idea="clip", file="nanocolossal/clip.py",
         old="summed(model_squares + summed(split_squares, split_group), model_group)",
         new="summed(model_squares + split_squares, model_group)",
         bug="the squares of parameters split over another group (ZeRO's segments, MoE's "
             "experts) are not summed over it: each rank clips by a different, smaller norm",
         tests=["tests/test_clip.py"]),
    dict(id="clip-replicas-counted-twice", idea="clip x tensor parallel",
         file="nanocolossal/clip.py",
         old="[1 / holders(p) for p in own]",
         new="[1.0 for p in own]",
         bug="a parameter every tensor rank holds alike (a LayerNorm, a row-parallel bias) adds "
             "its squares once per copy to the global gradient norm",
         tests=["tests/test_tensor_model.py", "-k", "training_equals_one_process"]),
    dict(id="scaler-growth-after-overflow", idea="AMP loss scaler",
         file="nanocolossal/amp_scaler.py",
         old="            self.growth_tracker = 0\n            self.consecutive_overflows += 1",
         new="            self.consecutive_overflows += 1",
         bug="an overflow does not restart the count of clean steps: the scale grows again "
             "sooner after a back-off than growth_interval allows",
         tests=["tests/test_amp.py", "-k", "scaler and not gloo"]),
    dict(id="lr-warmup-starts-at-zero", idea="LR schedulers",
         file="nanocolossal/nn/lr_scheduler.py",
         old="            return base * (t + 1) / ramp",
         new="            return base * t / ramp",
         bug="the warm-up ramps from 0 (t / w, not (t + 1) / w): the first step's lr is 0 and "
             "every warm-up step is one behind Colossal-AI's",
         tests=["tests/test_timer_and_schedulers.py", "-k", "formula or gloo"]),
    # -- metrics, data, loss weights --------------------------------------------------------------
    dict(id="metrics-weight-dropped", idea="metrics", file="nanocolossal/metrics.py",
         old="*sums, total_weight = all_reduce_sum([float(v) * w for v in scalars] + [w], group)",
         new="*sums, total_weight = all_reduce_sum([float(v) for v in scalars] + [w], group)",
         bug="all_reduce_mean(weight=) divides the plain sum of the ranks' means by the summed "
             "weights (the weights are forgotten in the numerator)",
         tests=["tests/test_metrics.py", "-k", "all_reduce_mean or accuracy_is_exact or "
                "metrics_work or shape_mismatch"]),
    dict(id="metrics-2d-reduces-over-data", idea="metrics x 2d", file="nanocolossal/metrics.py",
         old="WORLD if gpc.pipeline_size > 1 or gpc.tensor_size > 1 else",
         new="WORLD if gpc.pipeline_size > 1 else",
         bug="with tensor parallelism Accuracy reduces over the data group only: under 2d a grid "
             "row's block of the batch is all that is counted",
         tests=["tests/test_composition.py", "-k", "tensor_x_data_parallel"]),
    dict(id="sampler-ignores-epoch", idea="sampler", file="nanocolossal/data.py",
         old="torch.Generator().manual_seed(self.seed + self.epoch)",
         new="torch.Generator().manual_seed(self.seed)",
         bug="the sampler's shuffle ignores set_epoch: every epoch repeats the same order",
         tests=["tests/test_data.py"]),
    dict(id="sampler-uneven-length", idea="sampler", file="nanocolossal/data.py",
         old="self.num_samples = len(range(self.rank, self.total_size, R))",
         new="self.num_samples = self.total_size // R",
         bug="with pad=False the sampler's length is rounded down: the ranks holding one more "
             "sample report one too few",
         tests=["tests/test_data.py"]),
    dict(id="loss-weights-forget-G", idea="loss weights", file="nanocolossal/loss_weights.py",
         old="return _piece_counts(counts, spans_sequence) * weighed_ranks(spans_sequence) / total",
         new="return _piece_counts(counts, spans_sequence) / total",
         bug="a piece's loss weight W_p / W forgets the factor G that the average over G ranks "
             "divides by again",
         tests=["tests/test_loss_weights.py", "-k",
                "unevenly_padded_ranks or padding_spread_unevenly_trains"]),
    dict(id="loss-weights-class-weights", idea="loss weights", file="nanocolossal/loss_weights.py",
         old="    return (weight.to(target.device)[target.masked_fill(~counted, 0)] * counted)"
             ".sum()",
         new="    return counted.sum()",
         bug="the counted targets ignore the class weights: a piece weighs its targets, not "
             "their weights, in the mean",
         tests=["tests/test_loss_weights.py", "-k",
                "class_weights and not in_more_layouts"]),
    dict(id="loss-weights-eval-even-shares", idea="loss weights",
         file="nanocolossal/loss_weights.py",
         old="    return counts / counts.sum()",
         new="    return torch.full_like(counts, 1.0 / len(counts))",
         bug="a pipeline's evaluation loss weighs each micro-batch 1/M, not by its share of the "
             "batch's counted targets: wrong where padding is spread unevenly",
         tests=["tests/test_loss_weights.py", "-k", "pipeline_evaluation"]),
    dict(id="loss-weights-short-group-as-whole", idea="loss weights x accumulation",
         file="nanocolossal/loss_weights.py",
         old="        k = len(self.group)\n",
         new="        k = gpc.config.gradient_accumulation\n",
         bug="an epoch's short last group of k micro-steps weighs as a whole group of N: its "
             "gradient is N / k times one process's",
         tests=["tests/test_loss_weights.py", "-k", "over_micro_steps_as_one_process"]),
    dict(id="loss-weights-group-read-while-open", idea="loss weights x accumulation",
         file="nanocolossal/loss_weights.py",
         old="        check_group_ended(self.group is not None and self.total is not None, "
             "self.differs)\n",
         new="        check_group_ended(False, self.differs)\n",
         bug="a loader read one batch ahead (or past an unclosed short group) replaces the open "
             "group's labels without a word: its last batches weigh by the next group's count",
         tests=["tests/test_loss_weights.py", "-k", "next_group_while_one_is_open"]),
    dict(id="loss-weights-counted-when-read", idea="loss weights x evaluation",
         file="nanocolossal/loss_weights.py",
         old="        self.group = labels\n        self.total = self.differs = None\n",
         new="        self.group = labels\n        self.total = self.differs = None\n"
             "        if labels is not None:\n            self._counted()\n"
             "            self.total = None\n",
         bug="a group's targets are all-reduced when the loader reads it, not at its first "
             "weighed loss: evaluating on the training loader waits for a partner",
         tests=["tests/test_loss_weights.py", "-k", "reads_groups_ahead_all_reduces_nothing"]),
    dict(id="loss-weights-read-targets-unchecked", idea="loss weights x accumulation",
         file="nanocolossal/loss_weights.py",
         old="        self.seen = self.seen + count[0]\n",
         new="        self.seen = self.seen + self.read / k\n",
         bug="a group's losses are never compared with the targets read for it: a prefetcher a "
             "whole group ahead weighs every group by the next one's count, silently",
         tests=["tests/test_loss_weights.py", "-k", "other_targets_than_were_read"]),
    dict(id="initialize-loader-not-read-ahead", idea="loss weights x accumulation",
         file="nanocolossal/engine/initialize.py",
         old="        train_dataloader = training_loader(extensions, train_dataloader)\n",
         new="        pass\n",
         bug="initialize returns the training loader unwrapped: a loop of one's own weighs each "
             "micro-step 1 / N, not by its group's counted targets",
         tests=["tests/test_loss_weights.py", "-k", "over_micro_steps_as_one_process and loop"]),
    dict(id="trainer-loader-not-read-ahead", idea="loss weights x trainer",
         file="nanocolossal/trainer.py",
         old="batches = self.progress.batches(training_loader(self.engine.extensions, loader))",
         new="batches = self.progress.batches(loader)",
         bug="the Trainer reads a loader initialize never saw unwrapped: its micro-steps weigh "
             "1 / N, not by their group's counted targets",
         tests=["tests/test_loss_weights.py", "-k", "over_micro_steps_as_one_process and trainer"]),
    # -- pipeline ----------------------------------------------------------------------------
    dict(id="pipe-1f1b-warmup-off-by-one", idea="pipeline schedule",
         file="nanocolossal/pipeline/plan.py",
         old="    warmup = min(P - rank - 1, M)  # forwards until the first micro-batch's gradient",
         new="    warmup = min(P - rank, M)  # forwards until the first micro-batch's gradient",
         bug="1F1B runs one warm-up forward too many per rank (off by one): one more "
             "micro-batch's activations held than the schedule promises",
         tests=["tests/test_pipeline_plan.py"]),
    dict(id="pipe-interleaved-backward-chunk", idea="pipeline schedule",
         file="nanocolossal/pipeline/plan.py",
         old="return Compute(kind, chunk if kind == \"F\" else V - 1 - chunk, "
             "group * P + within % P)",
         new="return Compute(kind, chunk, group * P + within % P)",
         bug="interleaved 1F1B runs each group's backwards through the chunks in forward "
             "order, 0 to V-1, instead of V-1 down to 0",
         tests=["tests/test_pipeline_plan.py"]),
    dict(id="pipe-microbatch-share", idea="pipeline schedule",
         file="nanocolossal/pipeline/executor.py",
         old="self.share = [len(y) / len(labels) for y in self.y_mb]",
         new="self.share = [1 / len(self.y_mb) for y in self.y_mb]",
         bug="each micro-batch's loss weighs 1/M, not its share of the samples: wrong when a "
             "batch does not split evenly (13 samples in 4 micro-batches)",
         tests=["tests/test_pipeline.py", "-k", "any_batch"]),
    dict(id="p2p-grad-buffer-shape", idea="pipeline p2p", file="nanocolossal/pipeline/p2p.py",
         old="        for t in sorted(recvs):\n"
             "            shape, dtype = self._meta_of(t.src if t.what == \"act\" else t.dst, "
             "t.mb)",
         new="        for t in sorted(recvs):\n"
             "            shape, dtype = self._meta_of(t.src, t.mb)",
         bug="a gradient coming back is received into the shape of the boundary after its "
             "source, not the boundary it crosses",
         tests=["tests/test_pipeline.py::test_gloo_pipeline_schedules_equal_one_process"]),
    dict(id="tied-weight-not-summed", idea="pipeline tied weights",
         file="nanocolossal/pipeline/tied.py",
         old="        dist.all_reduce(param.grad, group=group)",
         new="        pass  # (the all-reduce over the stages holding the weight, dropped)",
         bug="a weight two stages share (the embedding tied to the classifier) steps with each "
             "stage's own gradient: the copies drift apart",
         tests=["tests/test_composition.py", "tests/test_train_gpt.py", "-k",
                "table and 1f1b or tied_embedding_stays_one_table"]),
    # -- tensor parallelism ---------------------------------------------------------------------
    dict(id="tensor-1d-copy-to-no-reduce", idea="tensor 1d", file="nanocolossal/tensor/comm.py",
         old="        return _all_reduce(grad, ctx.group), None\n\n\nclass _ReduceFrom",
         new="        return grad, None\n\n\nclass _ReduceFrom",
         bug="Megatron's f (copy_to) backward skips its all-reduce: the input gradient holds "
             "only this rank's slice's part",
         tests=["tests/test_tensor_layers.py", "-k",
                "1d_linear_pair or layers_equal_the_plain_layers"]),
    dict(id="tensor-2d-swapped-axis", idea="tensor 2d", file="nanocolossal/tensor/base.py",
         old='"col": lambda t, q: t % q, "row": lambda t, q: t // q % q,',
         new='"col": lambda t, q: t // q % q, "row": lambda t, q: t % q,',
         bug="a block split along the grid's row takes the row index for the column index: "
             "swapped grid axes",
         tests=["tests/test_tensor_model.py", "tests/test_tensor_layers.py", "-k",
                "2d_grid or layers_equal_the_plain_layers"]),
    dict(id="summa-backward-wrong-owner", idea="tensor 2d (SUMMA)",
         file="nanocolossal/tensor/summa.py",
         old="            if gpc.grid_col == k:  # I am (i, k)\n                dx = total",
         new="            if gpc.grid_row == k:  # I am (i, k)\n                dx = total",
         bug="SUMMA's backward keeps dX_ik on the rank whose grid row is k instead of its "
             "column: the reduced block lands on the wrong rank",
         tests=["tests/test_tensor_model.py", "tests/test_tensor_layers.py", "-k",
                "2d_grid or summa or layers_equal_the_plain"]),
    dict(id="layernorm-2d-wrong-group", idea="tensor 2d", file="nanocolossal/tensor/layers_2d.py",
         old="copy_to(p, activation_split().batch_group)",
         new="copy_to(p, activation_split().hidden_group)",
         bug="a hidden-dimension vector (bias, LayerNorm) replicated down the column sums its "
             "gradient over the row group instead",
         tests=["tests/test_tensor_model.py", "tests/test_tensor_layers.py", "-k",
                "2d_grid or layers_equal_the_plain_layers"]),
    dict(id="vocab-range-off-by-one", idea="vocab parallel",
         file="nanocolossal/tensor/vocab_parallel.py",
         old="    return gpc.tensor_rank * per_rank, (gpc.tensor_rank + 1) * per_rank",
         new="    return gpc.tensor_rank * per_rank, (gpc.tensor_rank + 1) * per_rank - 1",
         bug="a rank's vocabulary range ends one id early: the last token of each block is "
             "found on no rank and embeds as zeros",
         tests=["tests/test_vocab_parallel.py", "-k",
                "tied_table_on_two_ranks or layers_equal_the_plain"]),
    dict(id="vocab-loss-local-max", idea="vocab parallel",
         file="nanocolossal/tensor/vocab_parallel.py",
         old="        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)",
         new="        pass  # (the all-reduce of the running max, dropped)",
         bug="the vocab-parallel cross entropy subtracts each rank's own max, not the global "
             "one, before summing exp() over the ranks",
         tests=["tests/test_vocab_parallel.py", "-k",
                "tied_table_on_two_ranks or layers_equal_the_plain"]),
    dict(id="vocab-argmax-offset", idea="vocab parallel",
         file="nanocolossal/tensor/vocab_parallel.py",
         old="ids = torch.where(value == best, index + rank * logits.shape[-1],",
         new="ids = torch.where(value == best, index,",
         bug="the vocab-parallel argmax forgets the rank's offset: predictions are indices "
             "into the rank's block, not token ids (a wrong shard offset)",
         tests=["tests/test_vocab_parallel.py", "-k",
                "tied_table_on_two_ranks or layers_equal_the_plain"]),
    # -- ZeRO ---------------------------------------------------------------------------------
    dict(id="zero-segment-offset", idea="ZeRO 1/2", file="nanocolossal/zero/optimizer.py",
         old="                segments.append((index, lo - at, hi - at))",
         new="                segments.append((index, lo, hi))",
         bug="a shard's segments are kept at their offsets in the flat buffer, not within their "
             "parameter (a wrong shard offset)",
         tests=["tests/test_zero.py", "-k", "on_two_ranks_equals or adamw_equals_one_process"]),
    dict(id="zero2-no-param-gather", idea="ZeRO 1/2", file="nanocolossal/zero/optimizer.py",
         old="if stepped and self.size > 1 and self.level < 3:",
         new="if stepped and self.size > 1 and self.level < 2:",
         bug="level 2 skips the all-gather of the updated parameters after the step: each rank "
             "sees only its own shard move",
         tests=["tests/test_zero.py", "-k", "on_two_ranks_equals or adamw_equals_one_process"]),
    dict(id="zero-clip-local-norm", idea="ZeRO x clip", file="nanocolossal/zero/optimizer.py",
         old="return super().clip_grad_norm_(max_norm, group, split_over=(mine, self.group))",
         new="return super().clip_grad_norm_(max_norm, group, split_over=(mine, None))",
         bug="ZeRO's gradient norm adds only this rank's shard: the squares are not summed over "
             "the data group",
         tests=["tests/test_zero.py", "-k", "clipping_really_clips"]),
    dict(id="zero3-shard-offset", idea="ZeRO 3", file="nanocolossal/zero/sharded_model.py",
         old="at = b.offsets[i] + s.lo - b.rank * b.shard",
         new="at = b.offsets[i] + s.lo",
         bug="level 3 reads a segment's reduced gradient at its offset in the whole unit, not in "
             "my shard of it (a wrong shard offset)",
         tests=["tests/test_zero3.py", "-k", "on_two_ranks_equals or adamw_equals_one_process"]),
    dict(id="zero3-sum-not-mean", idea="ZeRO 3", file="nanocolossal/zero/sharded_model.py",
         old="grads[offset: offset + p.numel()].copy_(p.grad.reshape(-1)).div_(self.size)",
         new="grads[offset: offset + p.numel()].copy_(p.grad.reshape(-1))",
         bug="level 3 reduce-scatters gradients without dividing by the data size",
         # (AdamW alone does not see it: Adam's step is nearly blind to the gradient's scale)
         tests=["tests/test_zero3.py", "-k",
                "on_two_ranks_equals or adamw_equals_one_process or clipping"]),
    dict(id="zero3-accumulation-overwrites", idea="ZeRO 3 x accumulation",
         file="nanocolossal/zero/sharded_model.py",
         old="                        target.grad.add_(reduced)",
         new="                        target.grad = reduced.clone()",
         bug="each reduction overwrites my gradient shard instead of adding to it: only the "
             "last backward before a step counts",
         tests=["tests/test_zero3.py", "-k", "gradient_accumulation"]),
    dict(id="zero3-release-keeps-buffer-views", idea="ZeRO 3 x a second initialize",
         file="nanocolossal/zero/sharded_model.py",
         old="            p.data = p.detach().clone()  # its own storage, no longer the buffer's",
         new="            pass  # (the parameters left as views of the old buffer)",
         bug="a second nc.initialize of a model ZeRO 3 holds leaves its parameters views of the "
             "first one's flat buffer, whose storage is then freed: the new shards are cut from "
             "nothing",
         tests=["tests/test_zero3.py", "-k", "initialized_twice"]),
    dict(id="zero3-non-finite-stepped", idea="ZeRO 3 rules",
         file="nanocolossal/zero/optimizer_checks.py",
         old="    if not found.item():\n        return",
         new="    if True:  # (the refusal, dropped)\n        return",
         bug="level 3 without AMP steps NaN gradients (a parameter read outside the forward "
             "reads the freed NaN element) into every shard instead of refusing the step",
         tests=["tests/test_zero3.py", "-k", "read_outside_the_forward_are_refused"]),
    dict(id="zero3-watch-after-gather", idea="ZeRO 3 rules",
         file="nanocolossal/zero/sharded_model_checks.py",
         old="                                                 prepend=True),",
         new="                                                 ),",
         bug="the first forward's watch marks a unit running only after the timeline has "
             "gathered it: the gather's own writes look like reads outside the unit, and every "
             "unit joins the root unit (nothing sharded is freed any more)",
         tests=["tests/test_zero3.py", "-k", "models_as_written"]),
    dict(id="zero3-unit-order-unchecked", idea="ZeRO 3 rules",
         file="nanocolossal/zero/sharded_model_checks.py",
         old="agreed = same_everywhere(self.fingerprint, self.group, gpc.device)",
         new="agreed = True",
         bug="the step no longer compares the units each rank gathered: same-sized units run "
             "on different ranks put parameters together from two units' shards, silently",
         tests=["tests/test_zero3.py", "-k", "refused_at_the_step"]),
    dict(id="zero-shard-size-floor-plus-one", idea="ZeRO 1/2",
         file="nanocolossal/zero/optimizer.py",
         old="self.shard = math.ceil(self.numel / size)  # padded: N shards of equal size",
         new="self.shard = self.numel // size + 1  # padded: N shards of equal size",
         bug="a flat buffer's shard size is numel // N + 1, not ceil(numel / N): where N divides "
             "the buffer, each shard gets an element of padding too many (trains the same; "
             "gathers N elements more, and a checkpoint's segments fall in other files)",
         tests=["tests/test_zero_traffic.py", "-k", "gloo"]),
    dict(id="zero1-unused-gets-zero-grad", idea="ZeRO 1 x pipeline x an unused parameter",
         file="nanocolossal/zero/optimizer.py",
         old="self.grad_target(s).grad = None if p.grad is None else p.grad.reshape(-1)[s.lo:s.hi]",
         new="self.grad_target(s).grad = (torch.zeros_like(self.grad_target(s)) if p.grad is None"
             " else p.grad.reshape(-1)[s.lo:s.hi])",
         bug="level 1 gives a parameter no rank used a zero gradient, not none: weight decay and "
             "momentum move what one process leaves alone",
         tests=["tests/test_composition.py", "-k", "table and unused"]),
    dict(id="zero-offload-no-copy-in", idea="ZeRO offload", file="nanocolossal/zero/offload.py",
         old="            torch._foreach_copy_([v for v, _ in pairs], [m for _, m in pairs], "
             "non_blocking=True)",
         new="            pass  # (the copy of the updated masters back into the model, dropped)",
         bug="offload steps the CPU masters but never copies them back into the model's segments: "
             "the model does not move",
         tests=["tests/test_zero_offload.py", "-k", "gloo"]),
    dict(id="zero-v01-placement-cpu-ignored", idea="ZeRO v0.1 config",
         file="nanocolossal/compat/zero_v01.py",
         old='return dict(level=3, offload="cpu" if placement == "cpu" else None), scaler, notes',
         new='return dict(level=3, offload=None), scaler, notes',
         bug="Colossal-AI v0.1's tensor_placement_policy='cpu' is read but ignored: level 3 runs "
             "without offload",
         tests=["tests/test_zero3.py", "-k", "v01_config_is_level3"]),
    # -- sequence parallelism -----------------------------------------------------------------
    dict(id="ring-causal-wrong-half", idea="ring attention",
         file="nanocolossal/tensor/ring_attention.py",
         old="return (ALL, FIRST, False) if s < r else (SECOND, ALL, False)",
         new="return (ALL, SECOND, False) if s < r else (SECOND, ALL, False)",
         bug="causal ring attention lets my queries meet the later zig-zag stripe of an earlier "
             "rank's block instead of its earlier one",
         tests=["tests/test_ring_attention.py", "-k", "equals_full_attention"]),
    dict(id="ring-no-rescale", idea="ring attention",
         file="nanocolossal/tensor/ring_attention.py",
         old="l.mul_(alpha).add_(lb * beta)",
         new="l.add_(lb * beta)",
         bug="the online softmax's running sum is not rescaled when the running max grows",
         tests=["tests/test_ring_attention.py", "-k", "equals_full_attention"]),
    dict(id="sequence-local-positions", idea="sequence parallel", file="nanocolossal/sequence.py",
         old="positions = zigzag_split(positions, 0, n, gpc.sequence_rank, even)",
         new="positions = positions[: ids.shape[1]]",
         bug="a token's position is its index in this rank's share, not in the whole sequence",
         tests=["tests/test_sequence.py", "-k", "equals_one_process"]),
    dict(id="sequence-loss-local-count", idea="sequence parallel", file="nanocolossal/sequence.py",
         old="    dist.all_reduce(count, group=gpc.sequence_group)",
         new="    pass  # (the count of the other sequence ranks' targets, dropped)",
         bug="a sequence rank divides its tokens' loss by its own targets, not by the whole "
             "sequences' count: a mean of per-rank means, which weighs padding",
         tests=["tests/test_sequence.py::test_gloo_sequence_parallel_on_two_ranks_equals_one_"
                "process"]),
    # -- experts (MoE) ------------------------------------------------------------------------
    dict(id="moe-capacity-off-by-one", idea="MoE routing", file="nanocolossal/moe/router.py",
         old="    kept = position < capacity",
         new="    kept = position <= capacity",
         bug="an expert keeps C + 1 tokens: the first token over capacity is not dropped",
         tests=["tests/test_moe.py"]),
    dict(id="moe-top2-queue-jump", idea="MoE routing", file="nanocolossal/moe/router.py",
         old="places = onehot.cumsum(0) - 1 + queued",
         new="places = onehot.cumsum(0) - 1",
         bug="top-2's second choices queue from slot 0, not behind every first choice: they "
             "take the slots of first choices",
         tests=["tests/test_moe.py"]),
    dict(id="moe-combine-unweighted", idea="MoE dispatch", file="nanocolossal/moe/layer.py",
         old="weighted = results[slot] * weight.unsqueeze(-1).to(results.dtype)",
         new="weighted = results[slot]",
         bug="the combine forgets the router's weights: expert outputs come back unweighted "
             "(and the router gets no gradient)",
         tests=["tests/test_moe.py"]),
    dict(id="moe-aux-local", idea="MoE balance loss", file="nanocolossal/moe/balance.py",
         old="    stats = group_sum(stats, group)",
         new="    stats = stats",
         bug="the load-balancing loss takes its means over this rank's tokens, not the global "
             "batch's (a missed all-reduce)",
         tests=["tests/test_expert_parallel.py", "-k",
                "on_two_ranks_equals or training_equals_one_process"]),
    dict(id="moe-expert-grad-divisor", idea="MoE gradients", file="nanocolossal/moe/grads.py",
         old="            sum_gradients(params, holders, self.data_size)",
         new="            sum_gradients(params, holders, group_size(holders))",
         bug="an expert's gradient is divided by the ranks holding it, not by the data-parallel "
             "size: `peers` times too large (what DDP on the expert-data group would do)",
         tests=["tests/test_moe_train.py", "-k", "engine_training_equals_one_process"]),
    # -- checkpoints, trainer -------------------------------------------------------------------
    dict(id="ckpt-merge-2d-swapped", idea="checkpoint", file="nanocolossal/checkpoint/merge.py",
         old="for i in range(parts)], dim=dim)",
         new="for i in reversed(range(parts))], dim=dim)",
         bug="merging puts a split parameter's blocks back in reverse order along each split "
             "(the last rank's block first)",
         tests=["tests/test_checkpoint.py", "-k", "2d_tensor_parallel_checkpoint"]),
    dict(id="ckpt-rng-of-rank0", idea="checkpoint", file="nanocolossal/checkpoint/save_load.py",
         old="mine = rng[gpc.gradient_rank] if gpc.gradient_rank < len(rng) else None",
         new="mine = rng[0] if gpc.gradient_rank < len(rng) else None",
         bug="every data rank resumes with rank 0's RNG state: dropout and augmentation masks "
             "repeat across ranks after a resume",
         tests=["tests/test_checkpoint.py", "-k", "rng_state"]),
    dict(id="ckpt-optimizer-state-not-loaded", idea="checkpoint x every layout",
         file="nanocolossal/checkpoint/save_load.py",
         old="    if optimizer is not None and state.get(\"optimizer\") is not None:",
         new="    if False and optimizer is not None and state.get(\"optimizer\") is not None:",
         bug="load_checkpoint restores the model but not the optimizer: a resumed run starts its "
             "momentum afresh (the plain route, a merged model with a fresh optimizer, is right)",
         tests=["tests/test_composition.py", "-k", "resumed"]),
    dict(id="ckpt-saved-mid-group", idea="checkpoint x accumulation",
         file="nanocolossal/plain_optimizer.py",
         old="    def backward(self, loss: torch.Tensor) -> None:\n        self.open_group = True",
         new="    def backward(self, loss: torch.Tensor) -> None:\n        self.open_group = False",
         bug="the optimizer forgets that a backward opened an accumulation group: a checkpoint "
             "saved mid-group is taken, and the resumed run mixes micro-steps of two steps",
         tests=["tests/test_checkpoint.py", "-k", "middle_of_an_accumulation_group"]),
    dict(id="ckpt-saved-mid-pipeline-step", idea="checkpoint x pipeline",
         file="nanocolossal/engine/engine.py",
         old="            self._ended = True\n            self.optimizer.open_group = True\n",
         new="            self._ended = True\n            self.optimizer.open_group = False\n",
         bug="a pipeline's schedule runs the backwards without the optimizer knowing: a checkpoint "
             "saved before engine.step() is taken without the batch's gradients",
         tests=["tests/test_checkpoint.py", "-k", "middle_of_an_accumulation_group and pipeline"]),
    dict(id="engine-zero-grad-keeps-unstepped", idea="engine", file="nanocolossal/engine/engine.py",
         old="        if self._micro > 0 and not self._ended:\n",
         new="        if self._micro != 0:\n",
         bug="engine.zero_grad() keeps the gradients of a backward that took no step (a dry run, "
             "a skipped batch): they are added into the next step's",
         tests=["tests/test_engine.py", "-k", "dropped_by_zero_grad"]),
    dict(id="amp-stale-overflow-flag", idea="engine x amp", file="nanocolossal/amp.py",
         old="        super().drop_gradients()\n        self._flag = None\n",
         new="        super().drop_gradients()\n",
         bug="a dropped backward's overflow flag outlives zero_grad: the next step skips its "
             "unscale (fp16: gradients times the loss scale; O2: masters without gradients)",
         tests=["tests/test_engine.py", "-k", "dropped_by_zero_grad and fp16"]),
    dict(id="engine-outside-backward-silent", idea="engine", file="nanocolossal/engine/engine.py",
         old="                check_outside_backward(self)\n",
         new="                pass\n",
         bug="a loss.backward() past the engine goes unnoticed: engine.step() never steps, and "
             "says nothing",
         tests=["tests/test_engine.py", "-k", "past_the_engine"]),
    dict(id="ckpt-older-save-loaded", idea="checkpoint files",
         file="nanocolossal/checkpoint/save_load.py",
         old="and name_kind(path, f) != name_kind(path, file) and f.stat().st_mtime_ns > written]",
         new="and name_kind(path, f) != name_kind(path, file) and f.stat().st_mtime_ns < written]",
         bug="load_checkpoint compares file times the wrong way round: this layout's older files "
             "load beside another layout's newer save, and a newer one of its own is refused",
         tests=["tests/test_checkpoint.py", "-k", "older_than_another"]),
    dict(id="resume-skip-off-by-one", idea="trainer resume",
         file="nanocolossal/checkpoint/progress.py",
         old="    for _ in range(skip):",
         new="    for _ in range(skip - 1):",
         bug="resuming mid-epoch skips one batch too few: the last batch before the save is "
             "trained on twice",
         tests=["tests/test_trainer.py", "-k", "resumes_bit_identically"]),
    dict(id="stream-epoch-not-set", idea="trainer x streams",
         file="nanocolossal/checkpoint/progress.py",
         old='for owner in (getattr(loader, "sampler", None), getattr(loader, "dataset", None)):',
         new='for owner in (getattr(loader, "sampler", None),):',
         bug="a DataLoader over an IterableDataset is never told the epoch: every epoch repeats "
             "the first one's order",
         tests=["tests/test_trainer.py", "-k", "IterableDataset"]),
    dict(id="batch-not-a-pair-unpacked", idea="engine", file="nanocolossal/engine/engine.py",
         old="        check_batch(batch, return_loss)\n        inputs, label = batch",
         new="        inputs, label = batch",
         bug="a lone tensor of two rows is unpacked into inputs and labels: row 0 is trained to "
             "predict row 1, without an error",
         tests=["tests/test_engine.py", "-k", "not_inputs_and_labels"]),
    dict(id="trainer-epoch-end-group", idea="trainer x accumulation",
         file="nanocolossal/trainer.py",
         old="            if len(group) < n:\n",
         new="            if len(group) < n - 1:\n",
         bug="an epoch's last group one batch short of N is not closed (off by one), so it "
             "carries over into the next epoch",
         tests=["tests/test_trainer.py", "tests/test_composition.py", "-k",
                "trainer_x_accumulation_x_syncbn or resumes_bit_identically or readahead"]),
    dict(id="plan-o1-weight-casts-dropped", idea="nanocolossal plan x AMP",
         file="nanocolossal/plan/activations.py",
         old="        total += _linear_weights(m, lay, layer) * w.a\n    return total",
         new="        total += 0\n    return total",
         bug="the planner forgets the half copies of the weights autocast (O1) makes at each "
             "forward and the Linears keep for backward: activations planned too low",
         tests=["tests/test_composition.py::test_gloo_composition_table_row_trains_as_one_"
                "process[O1 x 1f1b x data2 x zero1]"]),
    dict(id="plan-recompute-not-counted", idea="nanocolossal plan x activation checkpointing",
         file="nanocolossal/plan/activations.py",
         old="        peak = max(peak, before + more)",
         new="        peak = max(peak, before)",
         bug="the planner counts a checkpointed block's kept input but not its tensors "
             "recomputed in backward: the peak planned far too low",
         tests=["tests/test_composition.py::test_gloo_composition_table_row_trains_as_one_"
                "process[checkpointing x 1f1b x data2]"]),
]
