#!/usr/bin/env bash
# tidal's GPU checks on one machine with one or more NVIDIA GPUs, in under 8 minutes, most telling first:
#   0. inventory: GPUs, versions, what is installed, sha256 throughput (what a checkpoint's hashing costs)
#   1. the weight channel: each chunk loaded after it lands, on the stream it came on (needs vLLM)
#   2. the sharded learner on one GPU: FSDP2 mixed precision against autocast's cast cache (peak memory),
#      a step with learner.fsdp.cpu_offload
#   3. the LM head's numerics at 7B's shape: fp32 head, bf16 logits, bf16 weights with fp32 sums
#   4. flash-attn taken only for half precision (where flash-attn is installed)
#   5. the rest of tests/gpu (Triton kernels at real tile sizes, packing, a bf16 step, two-GPU tests
#      where there are two GPUs: a worker on its own device, a worker killed mid-transfer)
#   6. the kernel benchmark (bench/kernels.py --quick)
#   7. a 2-minute real run (`tidal run` with vLLM actors) where vLLM is installed
# Needs torch, triton, transformers and accelerate; uses vLLM and flash-attn where present and names each
# part it skipped and why. Writes $OUT/report.json (each part's outcome and time, every number the checks
# printed) and each part's log beside it. Exit status: 1 if anything that ran failed.
#   scripts/gpu-check.sh            (PY=python3 by default; OUT=dir keeps the logs and the report)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export GPU_CHECK_LOG="$OUT/checks.jsonl" PYTHONUNBUFFERED=1
: > "$GPU_CHECK_LOG"
: > "$OUT/parts.jsonl"
failed=0

part() {  # part NAME SECONDS_LIMIT COMMAND...: run one part with a time limit, log it, record the outcome
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local code=${PIPESTATUS[0]} status=passed
    if [ "$code" -eq 5 ]; then status="skipped (no test ran)"  # pytest: every test deselected
    elif [ "$code" -ne 0 ]; then status="failed (exit $code)"; failed=1; fi
    printf '{"part": "%s", "status": "%s", "seconds": %d, "log": "%s"}\n' "$name" "$status" \
        $((SECONDS - start)) "$OUT/$name.log" >> "$OUT/parts.jsonl"
}
skip() { printf '{"part": "%s", "status": "skipped: %s"}\n' "$1" "$2" >> "$OUT/parts.jsonl"; echo "=== $1 skipped: $2"; }
has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
TESTS=("$PY" -m pytest -q -ra -s -p no:cacheprovider)

if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu-check: no CUDA device visible to $PY (torch.cuda.is_available() is False)" >&2
    exit 1
fi
if ! "$PY" -c "import tidal" 2>/dev/null; then
    echo "gpu-check: tidal is not importable by $PY; install it first: pip install -e '.[gpu,dev]'" >&2
    exit 1
fi

part inventory 60 "$PY" - <<'EOF'
import hashlib, importlib, json, os, time
import torch
found = {m: (getattr(importlib.import_module(m), "__version__", "?") if importlib.util.find_spec(m) else None)
         for m in ("torch", "triton", "transformers", "accelerate", "vllm", "flash_attn")}
gpus = [{"name": torch.cuda.get_device_name(i), "memory_gib": torch.cuda.get_device_properties(i).total_memory / 2**30}
        for i in range(torch.cuda.device_count())]
block = os.urandom(1 << 26)  # sha256 of 4 GiB in 64 MiB blocks, as a checkpoint's manifest hashes its files
start, digest = time.perf_counter(), hashlib.sha256()
for _ in range(64):
    digest.update(block)
line = {"check": "inventory", "gpus": gpus, "versions": found, "cuda": torch.version.cuda,
        "sha256_gib_per_s": 4 / (time.perf_counter() - start)}
print("GPU-CHECK", json.dumps(line))
open(os.environ["GPU_CHECK_LOG"], "a").write(json.dumps(line) + "\n")
EOF
if has vllm; then
    part weight-channel 90 "${TESTS[@]}" tests/gpu/test_weights_gpu.py -k "lands"
else
    skip weight-channel "vLLM is not installed (the worker receives through vLLM's NCCL engine)"
fi
part sharded-learner 200 "${TESTS[@]}" tests/gpu/test_learner_gpu.py -k "fsdp_mixed_precision or offloading"
part lm-head 60 "${TESTS[@]}" tests/gpu/test_learner_gpu.py -k "head"
if has flash_attn; then
    part flash-attn 60 "${TESTS[@]}" tests/gpu/test_learner_gpu.py -k "auto_attention"
else
    skip flash-attn "flash-attn is not installed"
fi
part gpu-tests 200 "${TESTS[@]}" tests/gpu -k "not lands and not fsdp_mixed_precision and not offloading and not head and not auto_attention"
part kernel-bench 90 "$PY" bench/kernels.py --quick
if has vllm; then
    model=${GPU_CHECK_MODEL:+model.path=$GPU_CHECK_MODEL}
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    share=""  # one GPU: the actor shares it with the learner (weights by tcp: NCCL needs a GPU per rank)
    [ "$gpus" -lt 2 ] && share="actor.colocate=true actor.vllm.gpu_memory_utilization=0.4 weights.transport=tcp"
    part real-run 240 "$PY" -m tidal run tiny ${model:-} $share run_dir="$OUT/run" learner.max_steps=20 \
        eval.every=10 actor.enforce_eager=false
else
    skip real-run "vLLM is not installed (pip install 'tidal[gpu]')"
fi

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
read = lambda name: [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]
report = {"parts": read("parts.jsonl"), "checks": read("checks.jsonl")}
(out / "report.json").write_text(json.dumps(report, indent=2))
print(f"\ngpu-check summary (logs and report.json in {out}):")
for p in report["parts"]:
    print(f"  {p['part']}: {p['status']}" + (f" in {p['seconds']}s" if "seconds" in p else ""))
for c in report["checks"]:
    print("  " + json.dumps(c))
EOF
exit $failed
