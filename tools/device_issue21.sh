#!/usr/bin/env bash
# Issue 21 (serving operations) on the lent GPU:
#   PART=sleep_startup|profile_startup|startup2|startup3|startup4 bash tools/device_issue21.sh
# Carry `.whl` and `device_tokenizer/` as tools/device_issue16.sh says. Logs and JSON go to
# $OUT.
set -uo pipefail
STEP_PATTERN="import folio|level [12]:|start-to-ready|ready in|latency:|passed|failed|Error|error"
. tools/device_common.sh
LAT="python3 -m folio.bench.latency --random-weights --input-len 32 --output-len 16 --max-model-len 2048 --num-iters-warmup 1 --num-iters 2 --no-roofline"
serve_ready() {  # seconds from `folio serve` to /health 200, then stop it
  timeout 200 python3 - "$1" "$2" "$OUT" <<'PY'
import subprocess, sys, time, urllib.request
model, name, out = sys.argv[1:4]
start = time.perf_counter()
log = open(f"{out}/{name}.log", "w")
proc = subprocess.Popen([sys.executable, "-m", "folio.entrypoints.cli", "serve", model,
                         "--port", "8123", "--max-model-len", "2048"],
                        stdout=log, stderr=subprocess.STDOUT)
while proc.poll() is None:
    try:
        if urllib.request.urlopen("http://127.0.0.1:8123/health", timeout=1).status == 200:
            break
    except OSError:
        time.sleep(0.05)
print(f"{name}: ready in {time.perf_counter() - start:.2f} s (rc {proc.poll()})", flush=True)
proc.send_signal(2)
proc.wait(60)
PY
}
case "${PART:-sleep_startup}" in
sleep_startup)
  # cold start (empty Triton cache), then warm restarts, with the stage timeline
  step 240 lat_qwen06_cold $LAT --config qwen3-0.6b
  step 120 lat_qwen06_warm $LAT --config qwen3-0.6b
  M=$(python3 -c "from folio.bench.random_model import build_random_model as b; print(b('qwen3-0.6b'))" | tail -1)
  serve_ready "$M" serve_warm1
  serve_ready "$M" serve_warm2
  step 200 sleep_qwen06 python3 tools/gpu_sleep_mode.py --config qwen3-0.6b \
      --out "$OUT/sleep_qwen06.json" ;;
profile_startup)  # cProfile of LLM() cold then warm; `folio serve` to /health warm
  step 200 profile_cold python3 tools/gpu_profile_startup.py
  step 120 profile_warm python3 tools/gpu_profile_startup.py
  M=$(python3 -c "from folio.bench.random_model import build_random_model as b; print(b('qwen3-0.6b'))" | tail -1)
  serve_ready "$M" serve_warm1
  serve_ready "$M" serve_warm2 ;;
startup2)  # after the autotune, KV-profile and bytecode caches: a cold start, then restarts
  # Python keeps bytecode here (the device's site-packages are read-only: without it every
  # start compiles ~1,800 modules, which no installed deployment does)
  [ -n "${KEEP_NO_BYTECODE:-}" ] || export PYTHONPYCACHEPREFIX=/tmp/pycache
  step 240 lat_qwen06_cold $LAT --config qwen3-0.6b
  step 120 lat_qwen06_warm $LAT --config qwen3-0.6b
  M=$(python3 -c "from folio.bench.random_model import build_random_model as b; print(b('qwen3-0.6b'))" | tail -1)
  serve_ready "$M" serve_warm1
  serve_ready "$M" serve_warm2
  grep -h "KV profiling\|KV cache:" "$OUT/serve_warm2.log" | head -3
  step 120 profile_warm python3 tools/gpu_profile_startup.py --top 30 ;;
startup3)  # bytecode written and read (startup2 kept PYTHONDONTWRITEBYTECODE, which the device
  # sets, so nothing was cached); then where a warm `folio serve` start goes, per process
  [ -n "${KEEP_NO_BYTECODE:-}" ] || unset PYTHONDONTWRITEBYTECODE
  [ -n "${KEEP_NO_BYTECODE:-}" ] || export PYTHONPYCACHEPREFIX=/tmp/pycache
  step 240 lat_qwen06_cold $LAT --config qwen3-0.6b
  step 120 lat_qwen06_warm $LAT --config qwen3-0.6b
  M=$(python3 -c "from folio.bench.random_model import build_random_model as b; print(b('qwen3-0.6b'))" | tail -1)
  serve_ready "$M" serve_warm1
  serve_ready "$M" serve_warm2
  PYTHONPROFILEIMPORTTIME=1 serve_ready "$M" serve_importtime
  grep -h "start-up\|KV profiling\|captured\|loaded" "$OUT/serve_warm2.log" | head -12
  step 120 profile_warm python3 tools/gpu_profile_startup.py --top 40 ;;
startup4)  # after the config snapshot (no transformers in the engine core): a first `folio
  # serve`, three restarts, each with the engine core's start-up timeline; LLM() warm
  [ -n "${KEEP_NO_BYTECODE:-}" ] || unset PYTHONDONTWRITEBYTECODE
  [ -n "${KEEP_NO_BYTECODE:-}" ] || export PYTHONPYCACHEPREFIX=/tmp/pycache
  M=$(python3 -c "from folio.bench.random_model import build_random_model as b; print(b('qwen3-0.6b'))" | tail -1)
  for run in serve_first serve_warm1 serve_warm2 serve_warm3; do
    serve_ready "$M" $run
    grep -h "start-up timeline\|ready .* after the command" "$OUT/$run.log" | sed 's/^.*: //'
  done
  step 120 lat_qwen06_warm $LAT --config qwen3-0.6b ;;
esac
