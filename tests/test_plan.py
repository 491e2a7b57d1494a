"""`nanocolossal plan` against what runs: the plan's model-state bytes equal the live tensors on
every rank exactly, its elements per step equal count_collectives() exactly, and its activation
peak is within 5% of SavedBytes.

The lesson below runs two rows of tests/test_composition.py's TABLE (data x ZeRO 1; 1d tensor x
1F1B) for two steps on gloo ranks (plan_runs.py) and compares every rank with the plan of its
pipeline and data rank. Every other TABLE row is checked the same way where it runs
(test_composition.py: the row trains as one process, then its plan is checked on the same
ranks), so a formula and the code drifting apart fails there. Below: the command line, a custom
model measured on the meta device, and the GPU bench's CPU path.
"""
import sys

import pytest
from dist_helpers import ROOT, run_ranks
from plan_runs import gpt_worker, plan_problems

sys.path.insert(0, str(ROOT))
import test_composition as tc  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("row", ["data2 x zero1", "1d x 1f1b"])
def test_gloo_plan_equals_live_tensors_and_collectives(row):
    """Model states exact on every rank, elements per collective exact, activations within 5%."""
    world, config, *_ = tc.TABLE[row]
    config = {**config, "clip_grad_norm": tc.CLIP}
    lives = run_ranks(gpt_worker, world, config, timeout=120)
    problems = plan_problems(world, config, lives)
    assert not problems, f"{row}:\n" + "\n".join(problems)


ZERO = {"level": 2}
O3 = {"mode": "apex", "opt_level": "O3", "dtype": "bfloat16"}
BEYOND_THE_TABLE = {  # world, config: what the table's rows (SGD, even shards) do not reach
    "adamw x data2 x zero1": (2, {"OPTIMIZER": "adamw", "zero": {"level": 1}}),
    "adamw x data2 x zero2 x offload": (2, {"OPTIMIZER": "adamw",
                                            "zero": {"level": 2, "offload": "cpu"}}),
    "adamw x data2 x zero3": (2, {"OPTIMIZER": "adamw", "zero": {"level": 3}}),
    "adamw x O3 x data2": (2, {"OPTIMIZER": "adamw", "fp16": O3}),
    "adamw x O2 x data2 x zero2": (2, {"OPTIMIZER": "adamw", "zero": ZERO,
                                       "fp16": {"mode": "naive", "dtype": "bfloat16"}}),
    "data3 x zero2 (uneven shards)": (3, {"zero": ZERO}),
    "data3 x zero3 (uneven shards)": (3, {"zero": {"level": 3}}),
    "moe x data2 (experts replicated)": (2, {**tc.MOE}),
    "moe x 1f1b x data2": (4, {**tc.MOE, "parallel": tc.PIPE2, **tc.PIPE}),
    "moe ep2 x 1f1b (a stage without experts)": (4, {**tc.MOE, **tc.PIPE,
                                                     "parallel": {**tc.PIPE2, **tc.EP2}}),
    "moe ep2 x data4 x handler": (4, {**tc.MOE, "parallel": tc.EP2, **tc.HANDLER_CFG}),
    "3d x 1f1b (16 ranks)": (16, {"parallel": {**tc.PIPE2, **tc.T3D}, **tc.PIPE}),
}


@pytest.mark.parametrize("row", BEYOND_THE_TABLE)
def test_gloo_plan_beyond_the_table_equals_live_tensors(row):
    """AdamW (its states in the stepped tensor's dtype, a step counter per segment a ZeRO rank
    steps), a data size that does not divide the flat buffers (the last shard short), MoE's
    clipping (a sum over the expert group only where a stage holds split experts), the cube's
    pipeline boundary (a rank sends its B S D / q^3 block)."""
    world, config = BEYOND_THE_TABLE[row]
    config = {**config, "clip_grad_norm": tc.CLIP}
    problems = plan_problems(world, config, run_ranks(gpt_worker, world, config, timeout=120))
    assert not problems, f"{row}:\n" + "\n".join(problems)


# -- the command line: bad input in one line, the big plan searched ----------------------------

def _run(argv, capsys):
    from nanocolossal.plan import main
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, says", [
    (["--config", "configs/gpt.py", "--world", "3"], "not a multiple of pipeline 1 x tensor 2"),
    (["--config", "configs/gpt.py", "--world", "2", "--heads", "3", "--dim", "129"],
     "HEADS=3 cannot be split over 2 ranks"),
    (["--config", "configs/gpt_2d.py", "--world", "4", "--memory", "lots"], "--memory"),
])
def test_plan_bad_input_is_one_line_saying_what_to_change(argv, says, capsys):
    code, out, err = _run([*argv[:1], str(ROOT / argv[1]), *argv[2:]], capsys)
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_plan_unknown_key_names_the_nearest(tmp_path, capsys):
    path = tmp_path / "typo.py"
    path.write_text("NUM_MICRO_BATCH = 4\nparallel = dict(pipeline=2)\n")
    code, _, err = _run(["--config", str(path), "--world", "2"], capsys)
    assert code == 2 and "NUM_MICRO_BATCH" in err and "NUM_MICRO_BATCHES" in err, err


SCRIPTS_REFUSE = {  # a config the scripts' load_config refuses: the key and what to write instead
    "zero = dict(level=5)": "zero level must be 1, 2 or 3, got 5: zero=dict(level=1)",
    "fp16 = dict(mode='bogus')": "fp16.mode: unknown fp16 mode 'bogus'; use one of AMP_TYPE.",
    "parallel = dict(pipline=2)": "unknown parallel key(s) ['pipline']; supported: pipeline",
    "parallel = dict(tensor=dict(size=2, mode='4d'))": "parallel.tensor needs mode='1d', '2d'",
    "BATCH_SIZE = -2": "BATCH_SIZE must be a positive integer, got -2",
    "fp16 = dict(mode='torch', dtype='half')": "fp16.dtype must be 'float16' or 'bfloat16'",
    "ddp = dict(bucket_mb=1)": "ddp must be a dict of bucket_cap_mb, gradient_as_bucket_view",
    "ACTIVATION_CHECKPOINT = 'some'": "ACTIVATION_CHECKPOINT='some': use 'full'",
    "SEQ_LEN = 63\nparallel = dict(tensor=dict(size=2, mode='sequence'))":
        "sequence length SEQ_LEN = 63 does not split into 2 x 2 zig-zag stripes",
    "NUM_EXPERTS = 3\nparallel = dict(moe=2)": "NUM_EXPERTS=3 does not fit parallel.moe size 2",
    "PIPELINE_SCHEDULE = '2f2b'": "PIPELINE_SCHEDULE must be one of 'gpipe', '1f1b'",
}


@pytest.mark.parametrize("text", SCRIPTS_REFUSE)
def test_plan_refuses_what_the_scripts_refuse_in_the_same_line(text, tmp_path, capsys):
    from nanocolossal.config import ConfigError, load_config
    path = tmp_path / "bad.py"
    path.write_text(text + "\n")
    code, _, err = _run(["--config", str(path), "--world", "8"], capsys)
    with pytest.raises(ConfigError) as scripts:
        load_config(path)
    assert code == 2 and err == f"nanocolossal plan: {scripts.value}\n", err
    assert SCRIPTS_REFUSE[text] in err, err


PLANNER_REFUSES = {  # what the scripts run, or refuse later, that the planner cannot count
    "DROPOUT = 0.1": "the planner does not count the dropout masks",
    "OPTIMIZER = 'lion'": "the planner counts 'adamw' (two states) or 'sgd'",
    "DEPTH = 0": "DEPTH must be a positive integer, got 0",
    "HEADS = 0": "HEADS must be a positive integer, got 0",
    "NUM_EXPERTS = 2\nparallel = dict(tensor=dict(size=2, mode='1d'))":
        "an MoE layer holds whole expert MLPs and does not split over tensor mode '1d'",
    "NUM_EXPERTS = 2\nACTIVATION_CHECKPOINT = 'full'": "would recompute an MoE block whole",
    "parallel = dict(pipeline=2)\nNUM_MICRO_BATCHES = 2\ngradient_accumulation = 2":
        "its micro-batches already accumulate",
}


@pytest.mark.parametrize("text", PLANNER_REFUSES)
def test_plan_refuses_what_it_cannot_count_in_one_line(text, tmp_path, capsys):
    path = tmp_path / "bad.py"
    path.write_text(text + "\n")
    code, _, err = _run(["--config", str(path), "--world", "8"], capsys)
    assert code == 2 and PLANNER_REFUSES[text] in err and err.count("\n") == 1, err


def test_plan_of_a_missing_config_file_is_one_line(tmp_path, capsys):
    code, _, err = _run(["--config", str(tmp_path / "none.py"), "--world", "2"], capsys)
    assert code == 2 and "none.py" in err and err.count("\n") == 1, err


def test_plan_search_proposes_only_layouts_that_launch(capsys):
    """An MoE config's search keeps what the scripts accept: no tensor mode, no ZeRO with
    expert parallelism, no full checkpointing of its blocks, no accumulation in a pipeline."""
    import json
    code, out, err = _run(["--config", str(ROOT / "configs/gpt_moe.py"), "--world", "8",
                           "--search", "--json"], capsys)
    assert code == 0, err
    for entry in json.loads(out)["layouts"]:
        lay = entry["layout"]
        assert lay["mode"] is None and lay["checkpoint"] != "full", lay
        assert not (lay["ep"] > 1 and lay["zero"]), lay


def test_plan_refuses_a_bad_config_without_torch(tmp_path):
    """The scripts' checks, every section of them, run in the planner without importing torch."""
    import subprocess
    for i, text in enumerate(SCRIPTS_REFUSE):
        (tmp_path / f"bad{i}.py").write_text(text + "\n")
    code = ("import sys\nfrom nanocolossal.run import main\n"
            f"for path in {sorted(map(str, tmp_path.glob('bad*.py')))!r}:\n"
            "    assert main(['plan', '--config', path, '--world', '8']) == 2, path\n"
            "assert 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m][:5]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stderr.count("\n") == len(SCRIPTS_REFUSE), out.stderr


SEVEN_B = dict(VOCAB=32000, SEQ_LEN=4096, DIM=4096, DEPTH=32, HEADS=32, MLP_RATIO=4,
               BATCH_SIZE=8, NUM_MICRO_BATCHES=8, parallel=dict(pipeline=4, tensor=dict(
                   size=8, mode="1d")), zero=dict(level=1), ACTIVATION_CHECKPOINT="full",
               fp16=dict(mode="torch", dtype="bfloat16"))


def test_plan_7b_on_64_ranks_searched(tmp_path, capsys):
    """A 7B-parameter GPT on 64 ranks of 80 GiB: its own plan and every layout, searched (how
    long it takes: bench/bench_plan.py)."""
    path = tmp_path / "gpt7b.py"
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in SEVEN_B.items()))
    code, out, err = _run(["--config", str(path), "--world", "64", "--memory", "80GiB",
                           "--search"], capsys)
    assert code == 0, err
    assert "layouts fit in 80.0 GiB" in out, out[-2000:]


def test_plan_json_has_the_config_layout_first(capsys):
    import json
    code, out, _ = _run(["--config", str(ROOT / "configs/gpt.py"), "--world", "4", "--json",
                         "--search"], capsys)
    data = json.loads(out)
    first = data["layouts"][0]
    assert first["layout"]["tensor"] == 2 and first["layout"]["mode"] == "1d"
    assert set(first["ranks"][0]["bytes"]) >= {"parameters", "gradients", "optimizer",
                                               "masters", "activations", "logits", "cpu",
                                               "total"}
    assert set(first["ranks"][0]["elements"]) >= {"all_reduce", "all_gather", "reduce_scatter",
                                                  "p2p", "all_to_all"}
    assert len(data["layouts"]) > 1


def test_plan_imports_no_torch():
    """`nanocolossal plan` needs no torch, whose import would be most of its time (only --model,
    measured on the meta device, imports it): a GPT and an MoE GPT planned and searched."""
    import subprocess
    code = ("import sys\nfrom nanocolossal.run import main\n"
            "for config in ('configs/gpt.py', 'configs/gpt_moe.py'):\n"
            "    assert main(['plan', '--config', config, '--world', '4', '--search']) == 0\n"
            "assert 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m][:5]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


# -- a custom model: measured on the meta device, then the data-parallel formulas -------------

CUSTOM = {  # world, config, images per micro-step, the model (plan_runs.py)
    "one rank": (1, {}, 4, "convnet"),
    "data2": (2, {}, 4, "convnet"),
    "data2 x zero1 x clip": (2, {"zero": {"level": 1}, "clip_grad_norm": 1.0}, 4, "convnet"),
    "data2 x zero2 x accum2": (2, {"zero": {"level": 2}, "gradient_accumulation": 2}, 2,
                               "convnet"),
    "data2 x zero3": (2, {"zero": {"level": 3}}, 4, "convnet"),
    "frozen conv x data2": (2, {}, 4, "frozen_convnet"),
    "frozen conv x data2 x zero3": (2, {"zero": {"level": 3}}, 4, "frozen_convnet"),
}


@pytest.mark.parametrize("row", CUSTOM)
def test_gloo_plan_of_a_measured_model_equals_live_tensors(row):
    """`--model plan_runs:convnet`: built on the meta device, its plan's model states and
    elements per step equal a live run's exactly; its activations and output what SavedBytes
    counts, the loss's own saved tensors apart (within 5%). A frozen layer is held whole on
    every rank, with no gradient, state or traffic."""
    from dataclasses import replace

    from plan_runs import convnet_worker

    from nanocolossal.plan.measure import load_measured, plan_measured
    world, config, micro, build = CUSTOM[row]
    cfg = {**config, "BATCH_SIZE": micro, "OPTIMIZER": "sgd"}
    m, lay = load_measured(f"plan_runs:{build}", f"{micro}x3x8x8:float64", cfg, world)
    (plan,) = plan_measured(m, replace(lay, backend="gloo"))
    states = sum(plan.bytes[k] for k in ("parameters", "gradients", "optimizer", "masters"))
    for r in run_ranks(convnet_worker, world, config, micro, build, timeout=120):
        assert r["parameters"] == plan.bytes["parameters"], (row, r["rank"])
        assert r["total"] == states, (row, r["rank"], r["total"], states)
        assert r["elements"] == {k: v for k, v in plan.elements.items() if v}, (row, r)
        act = plan.bytes["activations"] + plan.bytes["logits"]
        assert abs(act - r["saved"]) <= 0.05 * r["saved"], (row, act, r["saved"])


def test_plan_of_a_model_with_an_unused_parameter_is_one_line(capsys):
    code, _, err = _run(["--model", "plan_runs:unused_convnet", "--input", "4x3x8x8:float64",
                         "--world", "2"], capsys)
    assert code == 2 and "never.weight" in err and err.count("\n") == 1, err


# -- on one GPU: bench/bench_plan_gpu.py (bench/gpu_check.sh); on the CPU, the plan's code path --

@pytest.mark.timeout(120)
def test_the_plan_gpu_bench_runs_on_the_cpu_and_matches_live_tensors(tmp_path):
    """bf16 O1, AdamW, one rank, with and without full checkpointing: on the CPU the bench
    counts live tensors (what the plan models), so its states are exact and its peak within 5%."""
    import json

    from dist_helpers import run_cmd
    out = tmp_path / "plan_gpu.json"
    result = run_cmd([sys.executable, "-m", "bench_plan_gpu", "--cpu-small", "--out", str(out)],
                     timeout=100, cwd=ROOT / "bench")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [(r["batch"], r["checkpoint"]) for r in runs] == [
        (2, None), (2, "full"), (4, None), (4, "full")]
    for r in runs:
        assert r["states"] == r["plan_states"], r
        assert abs(r["ratio"] - 1) <= 0.05, r
