# Sourced by tools/device_issue*.sh on the lent GPU: installs the carried wheels (`.whl`, from
# ../shared/tools/device-wheels.sh), sets the environment (the carried `device_tokenizer/`
# for random-weight models), makes $OUT, and defines `step SECONDS NAME CMD...`: the command,
# at most SECONDS, into $OUT/NAME.log, and its summary lines (STEP_PATTERN) here.
# (.whl19: the embeddings bench's own set, sentence-transformers and its dependencies with the
# server's wheels, carried in place of .whl where both would pass the transfer limit.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $(if [ -d .whl19 ]; then ls .whl19/*.whl; else ls .whl/*.whl; fi) || exit 1
export PYTHONPATH=/tmp/site:$PWD FOLIO_CACHE_DIR=/tmp/folio-cache HF_HUB_OFFLINE=1
export FOLIO_RANDOM_TOKENIZER=$PWD/device_tokenizer PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEP_PATTERN=${STEP_PATTERN:-"latency:|decode:|roofline|Throughput|output tok/s|TTFT|prefill|passed|failed|Error|error"}
step() {
  local limit=$1 name=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -E "$STEP_PATTERN" "$OUT/$name.log" | tail -14
}
