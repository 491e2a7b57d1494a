import pytest
import torch
from dist_helpers import run_ranks

import nanocolossal as nc
from nanocolossal.metrics import Accuracy, all_reduce_mean

pytestmark = pytest.mark.timeout(120)

# 5 samples whose per-rank accuracies (pad=False shards [0, 2, 4] and [1, 3]) are 3/3 and 1/2:
# the exact answer is 4/5 = 0.8, while averaging the two ratios would give 0.75.
LOGITS = torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 2.0], [0.0, 2.0], [2.0, 0.0]])
TARGETS = torch.tensor([0, 0, 1, 1, 0])


def _accuracy_worker(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    sampler = nc.DistributedSampler(range(5), shuffle=False, pad=False)
    shard = list(sampler)
    accuracy = Accuracy()
    for i in shard:  # one sample at a time, as a loader with batch_size=1 would
        accuracy.update(LOGITS[i:i + 1], TARGETS[i:i + 1])
    return shard, accuracy.compute()


def test_gloo_accuracy_is_exact_over_uneven_shards():
    single = Accuracy()
    single.update(LOGITS, TARGETS)
    expected = single.compute()
    assert expected == 0.8
    out = run_ranks(_accuracy_worker, 2)
    assert [shard for shard, _ in out] == [[0, 2, 4], [1, 3]]
    assert [acc for _, acc in out] == [expected, expected]


def _mean_worker(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    plain = all_reduce_mean({"loss": float(rank + 1), "acc": torch.tensor(rank * 0.5)})
    scalar = all_reduce_mean(10.0 * (rank + 1))
    # rank 0 averaged 3 samples to 2.0, rank 1 averaged
    # 1 sample to 6.0: whole mean (6 + 6) / 4 = 3.0
    weighted = all_reduce_mean({"loss": [2.0, 6.0][rank]}, weight=[3, 1][rank])
    return plain, scalar, weighted


def test_gloo_all_reduce_mean_plain_and_weighted():
    for plain, scalar, weighted in run_ranks(_mean_worker, 2):
        assert plain == {"loss": 1.5, "acc": 0.25}
        assert scalar == 15.0
        assert weighted == {"loss": 3.0}


def test_metrics_work_in_one_process_without_launch():
    accuracy = Accuracy()
    accuracy.update(torch.tensor([1, 0, 1]), torch.tensor([1, 1, 1]))  # labels instead of logits
    assert accuracy.compute() == pytest.approx(2 / 3)
    accuracy.reset()
    with pytest.raises(ValueError, match="no samples"):
        accuracy.compute()
    assert all_reduce_mean({"a": 2.0}) == {"a": 2.0}


def test_accuracy_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError,
                       match=r"\[rank 0\] .*shape \(4,\) do not match targets of shape \(3,\)"):
        Accuracy().update(torch.zeros(4, 10), torch.zeros(3, dtype=torch.long))
