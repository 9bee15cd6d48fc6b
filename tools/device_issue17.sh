#!/usr/bin/env bash
# Issue 17 (speculative decoding) on the lent GPU:
#   PART=verify|editing|editing2|b64|s29b|s29a|s28e|s28d|s28c|s28b|s28a|s27a|s27b|s27c|s27d|s27e|s21|s21b|s22|s26a|s26d|s25a|s25c|s24b|s23b|s23 bash tools/device_issue17.sh
# Carry `.whl` and `device_tokenizer/` as tools/device_issue16.sh says. The real SmolLM2 GGUF
# (98 MB) is over one call's 64 MiB transfer, so it travels in two calls of a warm machine:
# `.smolA/part` with PART=verify (copied to /tmp/smol), `.smolB/part` with PART=editing,
# which joins them (split here: head -c 37748736 FILE > .smolA/part; tail -c +37748737 FILE
# > .smolB/part).
set -uo pipefail
STEP_PATTERN="verify|plain|ms/step|latency:|decode:|accept|spec|passed|failed|Error|error"
. tools/device_common.sh
SMOL=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
EDIT="python3 -m folio.bench.latency --model $SMOL --dataset editing --input-len 400 --no-roofline --max-model-len 1024 --num-iters-warmup 1"
# issue 16's batch-1 decode command (tools/device_issue16.sh's LAT)
LAT="python3 -m folio.bench.latency --random-weights --config llama3-8b --input-len 128
     --output-len 128 --max-model-len 4096 --max-num-seqs 1 --num-iters-warmup 1 --num-iters 3"
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
SUFFIX='{"method": "suffix", "num_speculative_tokens": 8}'
case "${PART:-verify}" in
s12b)  # session 12, again at the session's last code: batch 64 only (no probe)
  cat /tmp/smol/partA .smolB/part > $SMOL && ls -la $SMOL
  B64="--model $SMOL --dataset editing --batch-size 64 --input-len 200 --output-len 64 --num-iters-warmup 1 --num-iters 3 --no-roofline --max-model-len 512"
  step 140 b64_off python3 -m folio.bench.latency $B64
  step 140 b64_ngram python3 -m folio.bench.latency $B64 --speculative-config "$NGRAM"
  step 140 b64_suffix python3 -m folio.bench.latency $B64 --speculative-config "$SUFFIX"
  step 140 b64_off2 python3 -m folio.bench.latency $B64 ;;
s12)  # session 12 (after PART=s12d of device_issue16.sh copied .smolA): batch 64 with the
      # probes priced: off, ngram, suffix, off again, then the ngram probe
  cat /tmp/smol/partA .smolB/part > $SMOL && ls -la $SMOL
  B64="--model $SMOL --dataset editing --batch-size 64 --input-len 200 --output-len 64 --num-iters-warmup 1 --num-iters 3 --no-roofline --max-model-len 512"
  step 140 b64_off python3 -m folio.bench.latency $B64
  step 140 b64_ngram python3 -m folio.bench.latency $B64 --speculative-config "$NGRAM"
  step 140 b64_suffix python3 -m folio.bench.latency $B64 --speculative-config "$SUFFIX"
  step 140 b64_off2 python3 -m folio.bench.latency $B64
  STEP_PATTERN="latency:|decode:|steps|verify|plain|proposals|Error|error"
  step 150 probe_ngram python3 tools/gpu_spec_probe.py -- $B64 --speculative-config "$NGRAM"
  grep -A1 "the last 140" $OUT/probe_ngram.log | cut -c1-2500 ;;
copy)
  mkdir -p /tmp/smol && cp .smolA/part /tmp/smol/partA ;;
s27a)  # session 26, one call: the GPU tests of session 26's changes (the cache write in the
  # rotary's launch, bit-identical to the separate write; the graph runners' inputs in one
  # copy), FP8 batch-1 decode with that write and without (FOLIO_KV_WRITE=separate), the
  # verify cost with its gaps; the FP8 step's kernels charged by their exposed time if time
  # is left (gpu_kernel_census.py's new column)
  STEP_PATTERN="passed|failed|Error" step 210 gpu_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_cuda_graphs.py \
      tests/gpu/test_gpu_engine.py -k "graph or kv_write or pdl"
  STEP_PATTERN="latency:|decode:|roofline|Error" step 90 lat_fp8 $LAT --quantization fp8
  STEP_PATTERN="latency:|decode:|roofline|Error" step 80 lat_fp8_separate env \
      FOLIO_KV_WRITE=separate $LAT --quantization fp8
  step 110 verify python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --gaps
  STEP_PATTERN="kernels/token|Error" step 80 census_fp8_pdl python3 \
      tools/gpu_kernel_census.py 64 --config llama3-8b --quantization fp8 --graphs-only
  head -26 "$OUT/census_fp8_pdl.log" | cut -c1-170 ;;
s27c)  # (written while the norm epilogue was the default; since session 27 it is off, and
  # FOLIO_GEMV_NORM=1 times it) session 27's planned first call: the rotary's qk-norm sum in float64 (s27a: the variant
  # writing the cache had tuned other warps, and Qwen3's tokens moved) and the GEMVs ending
  # with the RMSNorm after them (bf16/FP8 skinny GEMV and the 4-bit GEMV; untested on a GPU):
  # their tests and the graph tests; then batch 1: FP8 with both fusions (default), W4A16,
  # FP8 without the norm epilogue (FOLIO_GEMV_NORM=0)
  STEP_PATTERN="passed|failed|Error" step 240 gpu_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_engine.py \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_quant.py \
      -k "kv_write or gemv_norm or pdl or graph or norm_epilogue"
  STEP_PATTERN="latency:|decode:|roofline|Error" step 150 lat_fp8 $LAT --quantization fp8
  STEP_PATTERN="latency:|decode:|roofline|Error" step 130 lat_w4a16 $LAT \
      --random-quantization w4a16
  STEP_PATTERN="latency:|decode:|roofline|Error" step 70 lat_fp8_no_norm_epilogue env \
      FOLIO_GEMV_NORM=0 $LAT --quantization fp8 ;;
s29b)  # session 29, after the kept copy views and stream: the verify cost alone (on an H200
  # run PART=s27h of tools/device_issue16.sh instead: this and issue 16's batch 1 together)
  STEP_PATTERN="verify|plain|Error" step 150 verify python3 tools/gpu_verify_cost.py \
      --config llama3-8b --k 4 --gaps ;;
s29a)  # session 29, first call: the spec-decode GPU tests (a fixed k now, and EAGLE-3's
  # streams out of the CUDA graphs, new in session 28), the host costs of the verify
  # turn-around's torch calls, then the verify cost (the target, on the H200)
  STEP_PATTERN="passed|failed|Error|identical" step 200 gpu_spec_tests python3 -m pytest -q -s \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_spec_decode.py
  STEP_PATTERN="host cost|Error" step 60 host_costs python3 tools/gpu_host_costs.py
  STEP_PATTERN="verify|plain|Error" step 150 verify python3 tools/gpu_verify_cost.py \
      --config llama3-8b --k 4 --gaps ;;
s28e)  # session 28, the last device minutes: s28d less its timeline; the verify cost only
  # where the card is the H200
  STEP_PATTERN="host cost|Error" step 60 host_costs python3 tools/gpu_host_costs.py
  STEP_PATTERN="passed|failed|Error|identical" step 170 gpu_spec_tests python3 -m pytest -q -s \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_spec_decode.py
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    STEP_PATTERN="verify|plain|Error" step 150 verify python3 tools/gpu_verify_cost.py \
        --config llama3-8b --k 4
  fi ;;
s28d)  # session 28, second call: the host's cost of each torch call in the verify turn-around
  # against alternatives (tools/gpu_host_costs.py), the spec-decode GPU test with a fixed k
  # (adaptive, it rested after one draft eagerly in s28c), the verify step's host timeline
  STEP_PATTERN="host cost|Error" step 60 host_costs python3 tools/gpu_host_costs.py
  STEP_PATTERN="passed|failed|Error|identical" step 150 gpu_spec_tests python3 -m pytest -q -s \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_spec_decode.py
  STEP_PATTERN="verify|plain|Error" step 150 verify_timeline python3 \
      tools/gpu_verify_cost.py --config llama3-8b --k 4 --host-timeline
  grep -E "timeline|build|copy|replay|record|schedule|update" "$OUT/verify_timeline.log" \
      | cut -c1-160 | head -40 ;;
s28c)  # session 28, first call on whichever card comes (starts scarce): issue 17's verify cost
  # first (its last target, on the H200), then the speculative-decoding GPU tests on session
  # 26-27's code (last run in session 25), then FP8 batch 1 (session 27's 3.63 on a tuning
  # chosen with the epilogue on; a fresh machine tunes on the plain product)
  STEP_PATTERN="verify|plain|Error" step 150 verify python3 tools/gpu_verify_cost.py \
      --config llama3-8b --k 4 --gaps
  STEP_PATTERN="passed|failed|Error" step 270 gpu_spec_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_spec_decode.py \
      tests/gpu/test_gpu_sampling.py
  STEP_PATTERN="latency:|decode:|roofline|Error" step 110 lat_fp8 $LAT --quantization fp8 ;;
s28b)  # session 28, after s27h: the speculative-decoding GPU tests on session 26-27's code (last
  # run in session 25), then s27e's selection again (28 of 29 passed there before its time ran out)
  STEP_PATTERN="passed|failed|Error" step 560 gpu_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_spec_decode.py \
      tests/gpu/test_gpu_quant.py tests/gpu/test_gpu_engine.py tests/gpu/test_cuda_graphs.py \
      -k "spec or eagle or draft or greedy_and_seeded or kv_write or gemv_norm or pdl or graph or norm_epilogue" ;;
s28a)  # next session, first call: the rest of s27e's GPU tests (its step ran out at 240 s after
  # 28 passed; the float64 qk-norm sum's bit-identity among those not reached), then the
  # verify step's host timeline with the small-batch flat-batch build (session 27's ~100 us)
  STEP_PATTERN="passed|failed|Error" step 420 gpu_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_engine.py \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_quant.py \
      -k "kv_write or gemv_norm or pdl or graph or norm_epilogue"
  STEP_PATTERN="verify|plain|Error" step 140 verify_timeline python3 \
      tools/gpu_verify_cost.py --config llama3-8b --k 4 --host-timeline
  grep -E "timeline|build|copy|replay" "$OUT/verify_timeline.log" | cut -c1-160 | head -40 ;;
s27e)  # session 27, first call (starts were scarce): s27c's GPU tests (the float64 rotary sum,
  # both GEMVs' norm epilogues, graphs), FP8 batch 1 with every fusion, then the verify step's
  # host turn-around in parts and its kernels (--host-timeline --profile)
  STEP_PATTERN="passed|failed|Error" step 240 gpu_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_engine.py \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_quant.py \
      -k "kv_write or gemv_norm or pdl or graph or norm_epilogue"
  STEP_PATTERN="latency:|decode:|roofline|Error" step 140 lat_fp8 $LAT --quantization fp8
  STEP_PATTERN="verify|plain|Error" step 150 verify_timeline python3 \
      tools/gpu_verify_cost.py --config llama3-8b --k 4 --host-timeline --profile
  grep -E "timeline|profile| ms/step " "$OUT/verify_timeline.log" | cut -c1-160 | head -80 ;;
s27d)  # (the epilogue's default as s27c says) right after s27c on the warm machine: W4A16 without the norm epilogue,
  # FP8 with neither fusion (FOLIO_KV_WRITE=separate FOLIO_GEMV_NORM=0)
  STEP_PATTERN="latency:|decode:|roofline|Error" step 100 lat_w4a16_no_norm_epilogue env \
      FOLIO_GEMV_NORM=0 $LAT --random-quantization w4a16
  STEP_PATTERN="latency:|decode:|roofline|Error" step 70 lat_fp8_neither env \
      FOLIO_GEMV_NORM=0 FOLIO_KV_WRITE=separate $LAT --quantization fp8 ;;
s27b)  # next: the rest of the GPU tests of sessions 25-26 (sampling, speculative decoding)
  STEP_PATTERN="passed|failed|Error" step 400 gpu_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_sampling.py \
      tests/gpu/test_gpu_spec_decode.py tests/gpu/test_fp8_kv_cache_gpu.py
  # the verify step's host turn-around in parts (session 27: which stretch of the host's
  # path from the kept tokens to the next replay is long on the GPU's host)
  STEP_PATTERN="verify|plain|timeline|us per|Error" step 130 verify_timeline python3 \
      tools/gpu_verify_cost.py --config llama3-8b --k 4 --host-timeline --profile ;;
s26d)  # next session: the EAGLE head trained on the CPU (tools/train_eagle_head.py) on the GPU,
  # held-out prompts at batch 1: off, the head at k = 2, 3, 4, n-gram; fixed k, then adaptive.
  # Two calls of one warm machine, each under the 64 MiB carry: PART=copy with .whl,
  # device_tokenizer and .smolA (the GGUF's first 44 MiB: head -c 46137344), then this with
  # .smolB (the rest: tail -c +46137345) and .cache/eagle-gpu (the head in bf16, 8 MiB, and
  # the prompts' data.pt; copies of .cache/eagle, which the training wrote)
  cat /tmp/smol/partA .smolB/part > $SMOL && ls -la $SMOL
  E="python3 tools/train_eagle_head.py --work-dir .cache/eagle-gpu
     --out .cache/eagle-gpu/smollm2-head2 --measure --measure-device cuda --measure-model $SMOL"
  STEP_PATTERN="MAL|tok/s|Error" step 250 eagle_fixed $E
  STEP_PATTERN="MAL|tok/s|Error" step 250 eagle_adaptive $E --adaptive ;;
s26a)  # next session: the GPU tests of session 25's changes (argmax_rows, the GEMV default
  # under speculation, graph pieces; the deepseek_v2 mixed-graph test that failed once on the
  # H200), then the verify cost as shipped (skinny kernel by default) with its gaps, and its
  # kernels one by one (PDL off) to find the verify step's extra device time
  STEP_PATTERN="passed|failed|Error" step 300 gpu_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_sampling.py \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_spec_decode.py
  step 100 verify python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --gaps
  STEP_PATTERN="verify|plain|profile|Error" step 120 verify_kernels env FOLIO_PDL=0 \
      python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --profile ;;
s25c)  # session 25: the deepseek_v2 mixed-graph test that failed in s25a (prompt 31, top-5
  # rule), in pieces and whole (PIECEWISE_MAX_TOKENS=0 set in-process), to tell a piece
  # hazard from an MoE routing near-tie; then issue 16's FP8 batch-1 decode kernel by kernel
  T="tests/gpu/test_cuda_graphs.py::test_mixed_step_graphs_match_eager_mixed_steps[deepseek_v2]"
  STEP_PATTERN="passed|failed|position|Error" step 100 ds_pieces python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf "$T"
  STEP_PATTERN="passed|failed|position|Error" step 100 ds_whole python3 -c \
      "import sys, pytest, folio.worker.mixed_graphs as m; m.PIECEWISE_MAX_TOKENS = 0; \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--noconftest', '-rf', '$T']))"
  STEP_PATTERN="kernels/token|Error" step 200 census_fp8 env FOLIO_PDL=0 python3 \
      tools/gpu_kernel_census.py 64 --config llama3-8b --quantization fp8 --graphs-only
  head -40 "$OUT/census_fp8.log" | cut -c1-170 ;;
s25a)  # next session: small mixed steps captured in graph pieces (one layer, three, the
  # rest) so a verify step's first kernel need not wait for the whole graph's launch (the
  # ~0.6-0.85 ms gap session 24 found); the GPU graph tests first, then the verify cost with
  # the gaps, in pieces and whole, cuBLAS and the skinny kernel for the 8 rows
  STEP_PATTERN="passed|failed|Error" step 260 graph_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_cuda_graphs.py \
      tests/gpu/test_gpu_spec_decode.py
  step 110 verify_pieces python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --gaps
  step 90 verify_whole python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --gaps \
      --whole-graphs
  step 90 verify_pieces_gemv env FOLIO_GEMV=all python3 tools/gpu_verify_cost.py \
      --config llama3-8b --k 4 ;;
s24b)  # session 24: the verify cost with the skinny kernel for the 5 rows (FOLIO_GEMV=all)
  # against cuBLAS, where a verify step's host time goes (cProfile), and the skinny kernel
  # against cuBLAS per Llama-3-8B projection at 1, 5 and 8 rows, every config timed
  step 200 verify_gemv_all env FOLIO_GEMV=all python3 tools/gpu_verify_cost.py --config llama3-8b --k 4
  step 220 verify_host python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --host-profile
  grep -E "breakdown|median|/step" "$OUT/verify_host.log" | cut -c1-200
  STEP_PATTERN="ALL OK|FAILED|Error" \
      step 170 gemv_rows python3 tools/gpu_check_gemv.py --models llama-3-8b --m 1,5,8 --timings
  grep -E "^llama" "$OUT/gemv_rows.log" | cut -c1-150 ;;
s23b)  # session 23: where a verify step's host time goes (cProfile of 65 plain and 65 verify
  # steps, with the per-part breakdown); then issue 16's batch-1 decode attention per split
  # count and tile at the latency bench's contexts; the verify cost with the skinny kernel
  # for the 5 rows (FOLIO_GEMV=all)
  step 260 verify_host python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --host-profile
  grep -E "breakdown|median|/step" "$OUT/verify_host.log" | cut -c1-200
  step 200 verify_gemv_all env FOLIO_GEMV=all python3 tools/gpu_verify_cost.py --config llama3-8b --k 4
  step 150 splits_b1 python3 tools/gpu_sweep_decode_splits.py --batches 1 --ctx 128,256,512 \
      --json "$OUT/splits_b1.json"
  grep "^b=" "$OUT/splits_b1.log" | cut -c1-250 ;;
s23)  # next session: the verify cost with the host's time per step in each part of
  # EngineCore.step (schedule, launch, wait, update), plain and verify; the GPU tests
  step 240 verify_llama8b python3 tools/gpu_verify_cost.py --config llama3-8b --k 4
  step 240 spec_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_spec_decode.py ;;
s22)  # session 22 (not run: the verify cost ran in device_issue16.sh s22c): the verify cost with greedy verify steps decided when their output is
  # taken (session 21), twice, with the profile once; then the GPU tests
  step 240 verify_llama8b_1 python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --profile
  step 200 verify_llama8b_2 python3 tools/gpu_verify_cost.py --config llama3-8b --k 4
  step 240 spec_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_spec_decode.py ;;
s21b)  # session 21: the verify cost once (verify steps left in flight since session 20)
  step 240 verify_llama8b python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 ;;
s21)
  # next session: verify steps left in flight (session 20), the verify cost twice, then the
  # speculative decoding GPU tests
  for r in 1 2; do
    step 240 verify_llama8b_$r python3 tools/gpu_verify_cost.py --config llama3-8b --k 4
  done
  step 240 spec_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_spec_decode.py ;;
verify)
  mkdir -p /tmp/smol && cp .smolA/part /tmp/smol/partA
  step 300 verify_llama8b python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --profile
  FOLIO_GEMV=all step 200 verify_llama8b_gemv_all python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 ;;
editing)
  cat /tmp/smol/partA .smolB/part > $SMOL && ls -la $SMOL
  step 120 edit_off1 $EDIT --output-len 384 --num-iters 5 --output-json $OUT/edit_off1.json
  step 120 edit_ngram1 $EDIT --output-len 384 --num-iters 5 --speculative-config "$NGRAM" --output-json $OUT/edit_ngram1.json
  step 120 edit_suffix1 $EDIT --output-len 384 --num-iters 5 --speculative-config "$SUFFIX" --output-json $OUT/edit_suffix1.json
  step 120 edit_off2 $EDIT --output-len 384 --num-iters 5
  step 120 edit_ngram2 $EDIT --output-len 384 --num-iters 5 --speculative-config "$NGRAM"
  B64="python3 -m folio.bench.latency --model $SMOL --dataset editing --batch-size 64 --input-len 200 --output-len 64 --num-iters-warmup 1 --num-iters 3 --no-roofline --max-model-len 512"
  step 150 b64_off $B64
  step 150 b64_ngram $B64 --speculative-config "$NGRAM"
  step 150 b64_off2 $B64 ;;
editing2)  # after the async-while-resting change: batch 64 both orders, batch 1 once more
  cat /tmp/smol/partA .smolB/part > $SMOL && ls -la $SMOL
  B64="python3 -m folio.bench.latency --model $SMOL --dataset editing --batch-size 64 --input-len 200 --output-len 64 --num-iters-warmup 1 --num-iters 3 --no-roofline --max-model-len 512"
  step 150 b64_off $B64
  step 150 b64_ngram $B64 --speculative-config "$NGRAM"
  step 150 b64_suffix $B64 --speculative-config "$SUFFIX"
  step 150 b64_ngram2 $B64 --speculative-config "$NGRAM"
  step 150 b64_off2 $B64
  step 120 edit_off $EDIT --output-len 384 --num-iters 5
  step 120 edit_ngram $EDIT --output-len 384 --num-iters 5 --speculative-config "$NGRAM"
  step 120 edit_suffix $EDIT --output-len 384 --num-iters 5 --speculative-config "$SUFFIX" ;;
probe)  # batch 64, ngram: each step's time (plain / verify), the draft-length decisions
  cat /tmp/smol/partA .smolB/part > $SMOL && ls -la $SMOL
  B64="--model $SMOL --dataset editing --batch-size 64 --input-len 200 --output-len 64 --num-iters-warmup 1 --num-iters 3 --no-roofline --max-model-len 512"
  STEP_PATTERN="latency:|decode:|steps|verify|plain|\(|proposals|Error|error"
  step 200 probe_ngram python3 tools/gpu_spec_probe.py -- $B64 --speculative-config "$NGRAM"
  step 100 b64_off python3 -m folio.bench.latency $B64 ;;
probe_suffix)  # batch 64, suffix: each step's time and the draft-length decisions
  cat /tmp/smol/partA .smolB/part > $SMOL && ls -la $SMOL
  B64="--model $SMOL --dataset editing --batch-size 64 --input-len 200 --output-len 64 --num-iters-warmup 1 --num-iters 3 --no-roofline --max-model-len 512"
  STEP_PATTERN="latency:|decode:|steps|verify|plain|\(|proposals|Error|error"
  step 200 probe_suffix python3 tools/gpu_spec_probe.py -- $B64 --speculative-config "$SUFFIX"
  grep -A1 "the last 140" $OUT/probe_suffix.log | cut -c1-3000 ;;
b64again)  # as b64, the GGUF already joined by an earlier call of this warm machine
  B64="python3 -m folio.bench.latency --model $SMOL --dataset editing --batch-size 64 --input-len 200 --output-len 64 --num-iters-warmup 1 --num-iters 3 --no-roofline --max-model-len 512"
  step 140 b64_off $B64
  step 140 b64_ngram $B64 --speculative-config "$NGRAM"
  step 140 b64_suffix $B64 --speculative-config "$SUFFIX"
  step 140 b64_off2 $B64 ;;
b64)  # batch 64 only (fits one call): off, ngram, suffix, off again
  cat /tmp/smol/partA .smolB/part > $SMOL && ls -la $SMOL
  B64="python3 -m folio.bench.latency --model $SMOL --dataset editing --batch-size 64 --input-len 200 --output-len 64 --num-iters-warmup 1 --num-iters 3 --no-roofline --max-model-len 512"
  step 140 b64_off $B64
  step 140 b64_ngram $B64 --speculative-config "$NGRAM"
  step 140 b64_suffix $B64 --speculative-config "$SUFFIX"
  step 140 b64_off2 $B64 ;;
esac
