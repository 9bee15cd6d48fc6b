#!/usr/bin/env bash
# Issue 23 (KV tiers) on the lent GPU:   PART=tests|bench|disagg|s16b|s16c|s18|s19|s19b|s20|s20b|s20c|s20d|s21 bash tools/device_issue23.sh
# Carry `.whl` and `device_tokenizer/` as tools/device_issue16.sh says.
#   tests: tests/gpu/test_gpu_kv_tiers.py (pinned host pool, CUDA graphs, disk tier restart),
#          tests/gpu/test_gpu_disagg.py (a consumer engine fetching prompts' KV from a producer)
#   bench: the seed's case at the Llama-3-8B shape: TTFT of a 1,600-token prefix as a device
#          hit, from the host tier, recomputed (targets: host <= 1.6x device, <= 0.4x recompute)
set -uo pipefail
STEP_PATTERN="TTFT|ITL|P/D|passed|failed|Error|error"
. tools/device_common.sh
llama8b() {  # the random-weight Llama-3-8B-shaped model's directory (built once per machine)
  python3 -c "from folio.bench.random_model import build_random_model as b; print(b('llama3-8b'))" | tail -1
}
# the seed's case: a 1,600-token prefix = 100 blocks; 400 device blocks, so four 1,600-token
# fillers evict it. $1: the step's time limit, $2: its name (log and JSON under $OUT)
kv_tiers_bench() {
  step "$1" "$2" python3 -m folio.entrypoints.cli bench kv-tiers --model "$(llama8b)" \
      --dtype bfloat16 --input-len 1600 --num-iters 5 --num-iters-warmup 1 \
      --max-model-len 2048 --num-gpu-blocks-override 400 --kv-offloading-size 4 \
      --output-json "$OUT/$2.json"
  tail -1 "$OUT/$2.log" | cut -c1-220
}
# prefill and decode as two servers on the one GPU, 8k-token prompts arriving while 16
# requests decode; the single server gets the same cache. $1: time limit, $2: name, $3: KV
# bytes per server, $4: more server arguments; the rest: more bench arguments. The servers'
# logs land in $OUT/$2_logs.
disagg_bench() {
  local limit=$1 name=$2 kv=$3 more=$4
  shift 4
  step "$limit" "$name" python3 -m folio.entrypoints.cli bench disagg --model "$(llama8b)" "$@" \
      --server-args "--dtype bfloat16 --max-model-len 8192 --kv-cache-memory-bytes $kv $more" \
      --num-decoders 16 --decode-input-len 128 --decode-output-len 256 --num-long 5 \
      --long-input-len 7936 --long-output-len 8 --long-interval 1.0 \
      --output-json "$OUT/$name.json"
  grep -E "^single|^disagg|^P/D|^ +(long|stalls)" "$OUT/$name.log" | cut -c1-400
  local logs
  logs=$(python3 -c "import json; print(json.load(open('$OUT/$name.json'))['logs'])" 2>/dev/null)
  # one file: a call brings back only a few
  [ -n "$logs" ] && tar czf "$OUT/${name}_logs.tgz" -C "$logs" .
}
case "${PART:-tests}" in
tests)
  step 400 kv_tiers_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf --tb=short \
      tests/gpu/test_gpu_kv_tiers.py tests/gpu/test_gpu_disagg.py ;;
s16b)
  # session 16, second call (next session's first): the norm-to-codes differences in detail
  # (the sum of squares now in float64: every row should read 0 and the test pass);
  # DeepSeek-V2's graph tests in the order of the full run (the mixed-step one failed there,
  # passed alone) with the autotuner's choices printed, then alone on poisoned memory
  step 90 norm_diag python3 tools/gpu_diag_norm_quant.py
  cut -c1-200 "$OUT/norm_diag.log"
  step 120 norm_test python3 -m pytest -q -p no:cacheprovider --noconftest -rf --tb=line \
      tests/gpu/test_gpu_quant.py -k "rms_norm_quantized or norm_quantized_rows"
  TRITON_PRINT_AUTOTUNING=1 step 200 graphs_dsv2 python3 -m pytest -q -p no:cacheprovider \
      --noconftest -rf --tb=line -s tests/gpu/test_cuda_graphs.py -k "deepseek_v2"
  grep -E "passed|failed|FAILED" "$OUT/graphs_dsv2.log" | tail -5
  # the same tests alone per model with the allocator's free memory full of NaN: an engine
  # that reads memory it never wrote shows it (fresh memory is usually zero)
  FOLIO_TEST_POISON_MEMORY=1 step 200 graphs_poisoned python3 -m pytest -q -p no:cacheprovider \
      --noconftest -rf --tb=line tests/gpu/test_cuda_graphs.py -k "mixed_step_graphs_match"
  grep -E "passed|failed|FAILED|Error" "$OUT/graphs_poisoned.log" | tail -6
  ;;
s16c)
  # session 16, third call: the host tier's load apart from the engine, then its saves and
  # loads pipelined (session 16) in the tests and the bench
  step 90 host_kv python3 tools/gpu_diag_host_kv.py
  cat "$OUT/host_kv.log"
  step 150 kv_tiers_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf --tb=short \
      tests/gpu/test_gpu_host_kv_pool.py tests/gpu/test_gpu_kv_tiers.py
  kv_tiers_bench 220 kv_tiers_llama8b ;;
s18)
  # session 18: the slot-major host tier (load of scattered slots, then the bench), and
  # whether an error raised in a C++ CPU extension crashes this host's torch
  step 60 host_kv python3 tools/gpu_diag_host_kv.py
  cat "$OUT/host_kv.log"
  kv_tiers_bench 150 kv_tiers_llama8b
  step 120 ext_errors python3 tools/diag_cpu_ext_errors.py
  cat "$OUT/ext_errors.log"
  step 150 kv_tiers_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf --tb=short \
      tests/gpu/test_gpu_kv_tiers.py
  tail -3 "$OUT/kv_tiers_tests.log" ;;
s19)
  # session 19: loads first, saves' copies after them, one event and the step as a graph
  step 150 tier_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf --tb=short \
      tests/gpu/test_gpu_host_kv_pool.py tests/gpu/test_gpu_kv_tiers.py
  tail -3 "$OUT/tier_tests.log"
  kv_tiers_bench 150 kv_tiers_llama8b ;;
s19b)
  # session 19, second call: the host tier twice more (is 1.45x reliable?), then issue 16's
  # decode split sweep (tools/device_issue16.sh s14c's first step) for the next session
  for r in 1 2; do
    kv_tiers_bench 150 kv_tiers_llama8b_$r
  done
  step 200 splits python3 tools/gpu_sweep_decode_splits.py --batches 1,4,16,64 \
      --ctx 128,256,512,2048,8192 --json "$OUT/splits.json"
  grep "^b=" "$OUT/splits.log" | cut -c1-250 ;;
s20)
  # session 20: where the P/D decoders stall. A second process's GPU bursts beside one server
  # (does time-slicing between processes stall decoding?), then the P/D bench with its stall
  # timeline and the servers' debug logs (fetch times, slow engine steps); the H100 holds two
  # servers only with 12 GiB of KV each. Last, the CPU kernels' formatted checks here.
  command -v nvidia-cuda-mps-control || echo "no nvidia-cuda-mps-control"
  nvidia-smi -q | grep -iE "compute mode|product name" | head -3
  step 200 colocated python3 tools/gpu_diag_colocated.py --model "$(llama8b)" \
      --server-args "--dtype bfloat16 --max-model-len 8192 --kv-cache-memory-bytes 12884901888" \
      --bursts 0.6:200:big,1.5:50:big,2.2:200:small --json "$OUT/colocated.json"
  grep -E "^ITL|^burst|^all stalls" "$OUT/colocated.log" | cut -c1-400
  disagg_bench 330 disagg_s20 12884901888 "--log-level debug"
  step 60 cpu_checks python3 -m pytest -q -p no:cacheprovider --noconftest -rf --tb=short \
      tests/model/test_cpu_attention.py tests/model/test_cpu_elementwise.py ;;
s20b)
  # session 20, second call: the engine loop no longer idles 0.5 s before a finished prefill's
  # hold goes out (the decode side's fetch waited for it); then the decoders' stalls under
  # the prefill's kernels: an MPS daemon (all SMs, then 60 % for the prefill), and a prefill
  # server that leaves the GPU between 1,024-token steps
  disagg_bench 120 disagg_loop 12884901888 "--log-level debug"
  disagg_bench 120 disagg_mps 12884901888 "--log-level debug" --mps
  disagg_bench 120 disagg_mps60 12884901888 "--log-level debug" --mps --mps-prefill-sm-percentage 60
  disagg_bench 120 disagg_chunks 12884901888 "--log-level debug" \
      --prefill-server-args "--max-num-batched-tokens 1024 --no-async-scheduling" ;;
s20c)
  # session 20, third call: is the MPS daemon with 60 % of the SMs for the prefill reliable
  # (0.34x once)? Twice more, and once at 50 %; the logs' slow steps and fetches carry wall
  # times to set beside the stall timeline
  disagg_bench 120 disagg_mps60_2 12884901888 "--log-level debug" --mps --mps-prefill-sm-percentage 60
  disagg_bench 120 disagg_mps60_3 12884901888 "--log-level debug" --mps --mps-prefill-sm-percentage 60
  disagg_bench 120 disagg_mps50 12884901888 "--log-level debug" --mps --mps-prefill-sm-percentage 50 ;;
s20d)
  # session 20, fourth call: the bench's defaults now (MPS where installed, the prefill at
  # 60 % of the SMs) twice, and without MPS once, the engine loop's fix in all
  disagg_bench 200 disagg_default_1 12884901888 ""
  disagg_bench 110 disagg_default_2 12884901888 ""
  disagg_bench 110 disagg_no_mps 12884901888 "" --mps off ;;
s21)
  # next session: the producer's pinned staging (test_gpu_disagg: one process, so the bytes
  # go through host memory) and the disk tier's reads on a thread, on the GPU
  step 400 kv_tiers_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      --tb=short tests/gpu/test_gpu_kv_tiers.py tests/gpu/test_gpu_disagg.py \
      tests/gpu/test_gpu_host_kv_pool.py
  tail -3 "$OUT/kv_tiers_tests.log" ;;
bench)
  kv_tiers_bench 500 kv_tiers_llama8b ;;
disagg)
  # prefill and decode as two servers on the one GPU (each 24 GiB of KV cache: an H200)
  disagg_bench 560 disagg_llama8b 25769803776 "" ;;
esac
