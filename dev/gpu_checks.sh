#!/usr/bin/env bash
# The checks a lent GPU machine runs in one call (the device tool's `run`, from the repo
# root, with `.whl` carried: bm25s and tensorboardX wheels, which that image lacks):
#   - the gpu-marked tests (a bf16 run; the learner on an NCCL rank, alone and in a run;
#     a rollout worker on the GPU, where the image has Ray);
#   - benchmarks/gpu.py's real section (a Qwen2.5-0.5B-shaped random model);
#   - the quick-start probe three ways at once, same seed: float32, bf16-mixed with the
#     bf16 sampler copy (the default), bf16-mixed sharing the learner's model.
# The probes are tiny and run beside the rest (stated in the results). Everything lands in
# $OUT (at most 8 files come back): the JSON results and one log per part.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
MINUTES=${PROBE_MINUTES:-3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/probes.log"
probe() {  # name, settings...
  local name=$1
  shift
  python3 benchmarks/gpu.py --sections probe --probe-minutes "$MINUTES" --probe-set "$@" \
    --out "/tmp/res/$name" --runs-dir "/tmp/runs/$name" >"/tmp/res/$name.log" 2>&1
}
mkdir -p /tmp/res
probe probe_fp32 model.precision=float32 &
probe probe_bf16 model.precision=bf16-mixed &
probe probe_bf16_shared rollout.sampler_weights=shared &
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_precision.py \
  tests/test_distributed_learner.py tests/test_distributed_train.py tests/test_rollout_workers.py \
  >"$OUT/tests.log" 2>&1
echo "pytest exit: $?" >>"$OUT/tests.log"
python3 benchmarks/gpu.py --sections real --out /tmp/res/real --runs-dir /tmp/runs/real \
  --setups "full, float32" "full, bf16-mixed, shared sampler" "full, bf16-mixed" \
  "LoRA r16, bf16-mixed" \
  >"$OUT/real.log" 2>&1
echo "real exit: $?" >>"$OUT/real.log"
wait
for name in probe_fp32 probe_bf16 probe_bf16_shared; do
  { echo "== $name"; tail -5 "/tmp/res/$name.log"; } >>"$OUT/probes.log"
done
cp /tmp/res/*.json "$OUT/" 2>/dev/null
ls "$OUT"
