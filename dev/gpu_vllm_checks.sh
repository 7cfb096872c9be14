#!/usr/bin/env bash
# The vLLM checks a lent GPU machine runs (the device tool's `run`, from the repo root).
# That machine has no vLLM and no package index, so vLLM comes in parts
# (dev/vllm_carry.py pack, here, makes .carry/vllm-1 ... vllm-N): one `run` call per
# part, back to back while the machine stays warm, each carrying its part. The calls before
# the last run `python3 dev/vllm_carry.py receive`; the last runs this script, which
# receives its part, unpacks them all, then runs the checks named in CHECKS (default
# "sleep backends workers", which fit one call's 600 s; "learn" takes a call of its own, a
# later one while the machine is warm, when the unpacked parts are still there):
#   - sleep: the gpu-marked vLLM test, the probe in bf16-mixed with vLLM colocated in sleep
#     mode (its peak memory and step time are printed);
#   - backends: benchmarks/backends.py's gpu section, a random Qwen2.5-0.5B-shaped model in
#     bf16, turnrl's vLLM path against raw vLLM on the same engine;
#   - workers: the gpu-marked rollout-worker test (a Ray worker's engine on the GPU; the
#     image has no Ray, so the parts bring it);
#   - learn: the gpu-marked vLLM learning test, the probe learnt with a vLLM rollout worker
#     and an NCCL learner rank on the GPU (its figures are printed);
#   - async: the gpu-marked asynchronous vLLM test, max_staleness 1 with partial rollouts,
#     the engine awake beside the learner on the GPU (a call of its own too, after learn).
# The tests run with `-W default`: warnings are shown in the log, not raised as the suite's
# settings raise them (a warning of a vLLM never run here must not cost the lent call).
# One after the other, not side by side: the benchmark's timings are the GPU's alone. Each
# has a deadline.
# Everything lands in $OUT: one log per part and the benchmark's JSON and Markdown.
set -u
OUT=${OUT:-/tmp/gpu_vllm_checks}
CHECKS=${CHECKS:-sleep backends workers}
mkdir -p "$OUT"
python3 dev/vllm_carry.py receive >"$OUT/receive.log" 2>&1
status=$?
cat "$OUT/receive.log"
[ "$status" -eq 0 ] || exit "$status"
export PYTHONPATH=/tmp/vllm-site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/versions.log"
python3 -c "import sys, torch, transformers, vllm
print('Python', sys.version.split()[0], 'torch', torch.__version__, 'transformers',
      transformers.__version__, 'vllm', vllm.__version__)" >>"$OUT/versions.log" 2>&1
cat "$OUT/versions.log"
wants() { case " $CHECKS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if wants sleep; then
  timeout 180 python3 -m pytest -q -s -p no:cacheprovider -W default -m gpu \
    -k "not asynchronous" tests/test_vllm_backend.py >"$OUT/test_gpu.log" 2>&1
  echo "pytest exit: $?" >>"$OUT/test_gpu.log"
  grep -E "peak|passed|failed|error|exit" "$OUT/test_gpu.log" | tail -5
fi
if wants backends; then
  timeout 240 python3 benchmarks/backends.py --sections gpu --out "$OUT/backends_gpu" \
    --runs-dir /tmp/runs >"$OUT/backends_gpu.log" 2>&1
  echo "backends exit: $?" >>"$OUT/backends_gpu.log"
  tail -12 "$OUT/backends_gpu.log"
fi
if wants workers; then
  timeout 110 python3 -m pytest -q -s -p no:cacheprovider -W default -m gpu \
    tests/test_rollout_workers.py >"$OUT/test_workers_gpu.log" 2>&1
  echo "pytest exit: $?" >>"$OUT/test_workers_gpu.log"
  tail -3 "$OUT/test_workers_gpu.log"
fi
if wants async; then
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider -W default -m gpu \
    -k asynchronous tests/test_vllm_backend.py >"$OUT/test_async_gpu.log" 2>&1
  echo "pytest exit: $?" >>"$OUT/test_async_gpu.log"
  grep -E "^async gpu|passed|failed|error|exit" "$OUT/test_async_gpu.log" | tail -6
fi
if wants learn; then
  timeout 540 python3 -m pytest -q -s -p no:cacheprovider -W default -m gpu \
    tests/test_vllm_learning.py >"$OUT/test_learn_gpu.log" 2>&1
  echo "pytest exit: $?" >>"$OUT/test_learn_gpu.log"
  grep -E "^gpu run|passed|failed|error|exit" "$OUT/test_learn_gpu.log" | tail -8
fi
