#!/usr/bin/env bash
# Issue 14 on the lent GPU: the GPU tests, then before/after benchmarks in one call.
#   PART=tests|bench|census|pdl|final bash tools/device_issue14.sh
# `device_baseline/` (untracked, made by `git archive <commit> folio tools pyproject.toml`) holds
# the code before the change; the repository root holds the code after it.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export FOLIO_CACHE_DIR=/tmp/folio-cache HF_HUB_OFFLINE=1
# A real BPE tokenizer for random-weight models and the structured GPU test: `device_tokenizer/`
# (untracked: the default model's tokenizer files).
export FOLIO_RANDOM_TOKENIZER=$PWD/device_tokenizer
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
root=$PWD
run_in() {  # run_in TREE NAME CMD...: the command with that tree's folio first on the path
  local tree=$1 name=$2; shift 2
  echo "=== $name ($(date +%T))"
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD "$@") > "$OUT/$name.log" 2>&1
  echo "rc=$?"; grep -E "latency:|decode:|step breakdown|Throughput|output tok/s|roofline|ms/step|requests:|passed|failed|Error" "$OUT/$name.log" | tail -8
}
LAT="-m folio.bench.latency --random-weights --config qwen3-0.6b --input-len 32 --output-len 128 --max-model-len 2048 --num-iters-warmup 2 --num-iters 5 --no-roofline"
THR="-m folio.bench.throughput --random-weights --config qwen3-0.6b --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 2048 --no-tqdm"
if [ "${PART:-tests}" = final ]; then
  run_in "$root/device_baseline" before_latency python3 $LAT
  run_in "$root" after_latency python3 $LAT --step-breakdown
  run_in "$root" after_latency_mp python3 $LAT --step-breakdown --distributed-executor-backend mp
  run_in "$root/device_baseline" before_latency_2 python3 $LAT
  run_in "$root" after_latency_2 python3 $LAT --step-breakdown
  run_in "$root" gpu_tests python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu
  grep -h "identical\|passed\|failed" "$OUT"/gpu_tests.log
elif [ "${PART:-tests}" = pdl ]; then
  run_in "$root" pdl_test python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_gpu_engine.py -k pdl tests/gpu/test_gpu_sampling.py
  run_in "$root" kernel_census python3 tools/gpu_kernel_census.py 64
  grep -A12 "===" "$OUT/kernel_census.log" | cut -c1-150
  run_in "$root/device_baseline" before_latency python3 $LAT
  run_in "$root" after_latency python3 $LAT --step-breakdown
  run_in "$root" after_latency_nopdl env FOLIO_PDL=0 python3 $LAT --step-breakdown
  run_in "$root/device_baseline" before_latency_2 python3 $LAT
  run_in "$root" after_latency_2 python3 $LAT --step-breakdown
  run_in "$root/device_baseline" before_throughput python3 $THR
  run_in "$root" after_throughput python3 $THR
elif [ "${PART:-tests}" = census ]; then
  run_in "$root" kernel_census python3 tools/gpu_kernel_census.py 64
  grep -A30 "===" "$OUT/kernel_census.log" | cut -c1-150
  run_in "$root/device_baseline" before_latency python3 $LAT
  run_in "$root" after_latency python3 $LAT --step-breakdown
  run_in "$root" gpu_tests python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu
elif [ "${PART:-tests}" = tests ]; then
  run_in "$root" gpu_tests python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu -s
  # Again with Triton's autotuning results cached on disk: the worker process then runs the
  # configs the in-process engine picked, and the tokens must be identical.
  run_in "$root" gpu_mp_exact env TRITON_CACHE_AUTOTUNING=1 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_gpu_engine.py -k mp_executor -s
  grep -h "identical with the mp\|passed\|failed" "$OUT"/gpu_*.log
else
  run_in "$root" gpu_structured python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_gpu_structured.py
  run_in "$root/device_baseline" before_latency python3 $LAT
  run_in "$root" after_latency python3 $LAT --step-breakdown
  run_in "$root/device_baseline" before_breakdown python3 tools/gpu_profile_decode.py qwen3-0.6b 256
  run_in "$root/device_baseline" before_throughput python3 $THR
  run_in "$root" after_throughput python3 $THR
  run_in "$root" after_latency_mp python3 $LAT --step-breakdown --distributed-executor-backend mp
  run_in "$root" after_throughput_mp python3 $THR --distributed-executor-backend mp
fi
