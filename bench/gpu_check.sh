#!/usr/bin/env bash
# The GPU checks of issue 34 on one GPU, in under 5 minutes (CI has no GPU: it runs none of them).
#
#     bash bench/gpu_check.sh     # from the repository root: .venv/bin/python if there, else python
#
# 1. the CUDA tests: tests/test_cuda.py, and the CUDA cases of test_attention.py (flash against
#    the explicit formula in bf16), test_lean_step.py (the Engine's step never synchronises),
#    test_amp.py and test_zero_offload.py (masters pinned on the CPU, the model on the GPU)
# 2. bench/bench_gpt_gpu.py (GPT-2 small, bf16): without torch.compile, then with it, then
#    --host-bound (its 12 layers at a tiny width: the host's cost per step)
#    (bench/results/gpt_gpu.json, gpt_gpu_compile.json, gpt_gpu_host_bound.json);
#    bench/bench_offload_gpu.py (ZeRO offload's step, reported: bench/results/offload_gpu.json);
#    bench/bench_plan_gpu.py (`nanocolossal plan` for GPT-2 small, bf16 O1, batch 8 and 32, with and
#    without checkpointing, against max_memory_allocated: bench/results/plan_gpu.json)
# 3. each goal with its measured figure and PASS or MISS; the exit status is 1 if one missed.
set -u
cd "$(dirname "$0")/.." || exit 1
if [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif command -v python >/dev/null; then PY=python
else PY=python3
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's package
"$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
    || { echo "gpu_check.sh: no CUDA device for $PY"; exit 1; }
start=$SECONDS

echo "== 1. CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider -k cuda tests/test_cuda.py tests/test_attention.py \
    tests/test_lean_step.py tests/test_amp.py tests/test_zero_offload.py
tests=$?
echo "== 2. bench_gpt_gpu.py"
"$PY" bench/bench_gpt_gpu.py --out bench/results/gpt_gpu.json
plain=$?
"$PY" bench/bench_gpt_gpu.py --compile --out bench/results/gpt_gpu_compile.json
compiled=$?
"$PY" bench/bench_gpt_gpu.py --host-bound --out bench/results/gpt_gpu_host_bound.json
host=$?
echo "== 2b. bench_offload_gpu.py (reported, no goal)"
"$PY" bench/bench_offload_gpu.py || echo "bench_offload_gpu.py failed (exit $?)"
echo "== 2c. bench_plan_gpu.py: nanocolossal plan vs max_memory_allocated (reported, no goal)"
"$PY" bench/bench_plan_gpu.py --out bench/results/plan_gpu.json \
    || echo "bench_plan_gpu.py failed (exit $?)"

echo "== 3. goals ($((SECONDS - start)) s in all)"
"$PY" - "$tests" "$plain" "$compiled" "$host" <<'EOF'
import json
import sys
from pathlib import Path

verdict = {True: "PASS", False: "MISS", None: "n/a"}
missed = sys.argv[1] != "0"
print(f"  {'CUDA tests pass':<40} {'':>14}  {verdict[not missed]}")
for name, path, status in (("", "gpt_gpu.json", sys.argv[2]),
                           (", compiled", "gpt_gpu_compile.json", sys.argv[3]),
                           (", host-bound", "gpt_gpu_host_bound.json", sys.argv[4])):
    if status != "0":
        print(f"  {'bench' + name + ' runs':<40} {'exit ' + status:>14}  MISS")
        missed = True
        continue
    path = Path("bench/results") / path
    for goal in json.loads(path.read_text())["goals"]:
        value = "-" if goal["value"] is None else f"{goal['value']:.3f}"
        print(f"  {goal['goal'] + name:<40} {value:>14}  {verdict[goal['met']]}")
        missed |= goal["met"] is False
sys.exit(1 if missed else 0)
EOF
