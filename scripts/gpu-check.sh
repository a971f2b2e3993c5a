#!/usr/bin/env bash
# Every GPU check of tidal at once, on one machine with one or more NVIDIA GPUs, in under 8 minutes:
#   1. the GPU tests (tests/gpu: Triton kernels at real tile sizes, flash-attn packing, bf16 mixed
#      precision on CUDA, two ranks over NCCL where there are two GPUs)
#   2. the kernel benchmark (bench/kernels.py --quick: JSON lines, ratios to the naive backend)
#   3. a 2-minute real run (`tidal run` with vLLM actors on the GPUs) where vLLM is installed;
#      GPU_CHECK_MODEL=/path/to/hf-model picks the model (default: the tiny model, built locally)
# A machine with torch, triton and accelerate but not vLLM or flash-attn runs what needs only those
# and names each part it skipped and why. Exit status: 1 if anything that ran failed.
#   scripts/gpu-check.sh            (PY=python3 by default; OUT=dir keeps the logs)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
declare -a SUMMARY
failed=0

part() {  # part NAME SECONDS_LIMIT COMMAND...: run one part with a time limit, log it, record the outcome
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local code=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    if [ "$code" -eq 0 ]; then SUMMARY+=("$name: passed in ${took}s")
    else SUMMARY+=("$name: FAILED (exit $code) after ${took}s, log $OUT/$name.log"); failed=1; fi
}
skip() { SUMMARY+=("$1: skipped: $2"); echo "=== $1 skipped: $2"; }
has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu-check: no CUDA device visible to $PY (torch.cuda.is_available() is False)" >&2
    exit 1
fi
"$PY" -c "import torch; print('GPUs:', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
if ! "$PY" -c "import tidal" 2>/dev/null; then
    echo "gpu-check: tidal is not importable by $PY; install it first: pip install -e '.[gpu,dev]'" >&2
    exit 1
fi

has flash_attn || echo "(flash-attn is not installed: its packing test will be skipped, named in the test report)"
part gpu-tests 300 "$PY" -m pytest -q -ra tests/gpu
part kernel-bench 180 "$PY" bench/kernels.py --quick
if has vllm; then
    model=${GPU_CHECK_MODEL:+model.path=$GPU_CHECK_MODEL}
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    share=""  # one GPU: the actor shares it with the learner
    [ "$gpus" -lt 2 ] && share="actor.colocate=true actor.vllm.gpu_memory_utilization=0.4"
    part real-run 240 "$PY" -m tidal run tiny ${model:-} $share run_dir="$OUT/run" learner.max_steps=20 \
        eval.every=10 actor.enforce_eager=false
else
    skip real-run "vLLM is not installed (pip install 'tidal[gpu]')"
fi

echo
echo "gpu-check summary (logs in $OUT):"
printf '  %s\n' "${SUMMARY[@]}"
exit $failed
