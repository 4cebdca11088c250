# rollfleet: every set-up step a fresh machine needs lives here.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench peers clean

# llama-cpp-python has no wheel: we build one, once per machine, for x86-64-v3 (AVX2/FMA/F16C).
# Never -march=native: on hosts with AMX a native build uses AMX tiles, which these VMs do not
# grant to processes, and every decode segfaults. Kept outside the checkout, like pip's own cache.
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
WHEELS ?= $(HOME)/.cache/rollfleet/wheels/llama-cpp-x86-64-v3

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the local CPU build: a looser pin would pull GBs of CUDA
	$(BIN)/pip install -q -c constraints.txt torch
	ls $(WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || CMAKE_ARGS="$(LLAMA_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(BIN)/pip wheel -q --no-deps --no-cache-dir -c constraints.txt -w $(WHEELS) llama-cpp-python
	$(BIN)/pip install -q --find-links $(WHEELS) -c constraints.txt -e '.[all,test]'
	touch $(STAMP)

install: $(STAMP)

# The main job on the embedded defaults: 52 math tasks, 4 runners, the bundled SmolLM2 on llama.cpp.
demo: $(STAMP)
	rm -rf .rollfleet/demo-run
	$(BIN)/rollfleet run --mode math --data src/rollfleet/examples/math.jsonl --num-rollouts 8 \
		--max-tokens 64 --output-dir .rollfleet/demo-run

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

# ruff (rules and line length in pyproject.toml) and mypy --strict over the package.
lint: $(STAMP)
	$(BIN)/ruff check src
	$(BIN)/ruff format --check src
	$(BIN)/mypy src

bench: $(STAMP)
	$(BIN)/python -m bench
	$(BIN)/python -m bench._report

# Peer projects for side-by-side benchmarks live in their own venv, never in .venv.
peers:
	test -d .venv-peers || $(PY) -m venv .venv-peers
	.venv-peers/bin/pip install -q -c constraints.txt torch agentlightning==0.3.0 'ray[default]' omegaconf hydra-core \
		numpy pyyaml aiohttp requests filelock packaging sortedcontainers
	.venv-peers/bin/pip install -q --no-deps rlinf==0.3.0

clean:
	rm -rf $(VENV) .venv-peers .rollfleet build *.egg-info
