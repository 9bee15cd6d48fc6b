#!/usr/bin/env bash
# One device call's worth of issue-4 measurements, in priority order, each bounded by a
# timeout so a hang cannot eat the session's device budget. Run on the GPU machine from the
# repository root with the environment docs/benchmarks.md describes (PYTHONPATH with the
# device wheels, FOLIO_RANDOM_TOKENIZER, HF_HUB_OFFLINE=1); results go to $OUT.
set -u
out=${OUT:?set OUT}
bench="python3 -m folio.bench"
qwen="--random-weights --config qwen3-0.6b --max-model-len 2048"
timeout 200 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu > "$out/gpu_tests.txt" 2>&1
tail -n 3 "$out/gpu_tests.txt"
timeout 150 $bench.throughput $qwen --num-prompts 256 --input-len-range 100 1024 \
    --output-len-range 100 1024 --no-tqdm --peer transformers-cb --peer-timeout 60 \
    > "$out/throughput.txt" 2>&1
tail -n 8 "$out/throughput.txt"
# A/B: vLLM's offline default budget on large GPUs (fewer, larger mixed steps).
timeout 90 $bench.throughput $qwen --num-prompts 256 --input-len-range 100 1024 \
    --output-len-range 100 1024 --no-tqdm --max-num-batched-tokens 8192 \
    > "$out/throughput_8192.txt" 2>&1
tail -n 5 "$out/throughput_8192.txt"
timeout 100 $bench.latency $qwen --input-len 32 --output-len 128 --num-iters-warmup 2 \
    --num-iters 5 > "$out/latency_qwen3.txt" 2>&1
FOLIO_GEMV=1 timeout 130 $bench.latency $qwen --input-len 32 --output-len 128 \
    --num-iters-warmup 2 --num-iters 5 > "$out/latency_qwen3_gemv.txt" 2>&1
tail -n 4 "$out/latency_qwen3.txt" "$out/latency_qwen3_gemv.txt"
FOLIO_GEMV=1 timeout 200 python3 -m pytest -q -p no:cacheprovider --noconftest \
    tests/gpu/test_gpu_engine.py tests/gpu/test_cuda_graphs.py > "$out/gpu_tests_gemv.txt" 2>&1
tail -n 3 "$out/gpu_tests_gemv.txt"
# Prefill-heavy (mixed eager steps dominate) and decode-heavy (graph replays dominate).
timeout 90 python3 tools/gpu_profile_batch_kernels.py 256 600 48 > "$out/batch_kernels_prefill.txt" 2>&1
timeout 120 python3 tools/gpu_profile_batch_kernels.py 256 300 600 > "$out/batch_kernels_decode.txt" 2>&1
