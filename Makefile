# rollfleet: every set-up step a fresh machine needs lives here.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint docs bench peers llama-server clean

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
	# openenv-core, for the tests that start a real OpenEnv server (the openenv mode itself needs
	# none of it): its gradio would pin pillow below 13, and its server runs without gradio, so
	# it goes in without its dependencies, beside the ones its server imports
	$(BIN)/pip install -q -c constraints.txt fastmcp tomli tomli-w
	$(BIN)/pip install -q --no-deps -c constraints.txt openenv-core
	# verifiers 0.4, for the tests of its adapter: it pins openai<3 and mcp==2.0.0, older than what
	# the rest of this venv has, and runs with both, so it too goes in without its dependencies,
	# beside the ones it imports
	$(BIN)/pip install -q -c constraints.txt aiohttp anthropic gepa httpx2 loguru math-verify \
		prime-pydantic-config prime-runs prime-sandboxes prime-tunnel pyzmq renderers tenacity
	$(BIN)/pip install -q --no-deps -c constraints.txt verifiers
	touch $(STAMP)

install: $(STAMP)

# The main job on the embedded defaults: 52 math tasks, 4 runners, the bundled SmolLM2 on llama.cpp.
demo: $(STAMP)
	rm -rf .rollfleet/demo-run
	$(BIN)/rollfleet run --mode math --data src/rollfleet/examples/math.jsonl --num-rollouts 8 \
		--max-tokens 64 --output-dir .rollfleet/demo-run

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

# The inner loop: the unit tests, no model, no browser, no server process.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra tests/unit -m "not llamacpp and not browser and not slow"

# ruff (rules and line length in pyproject.toml) and mypy --strict over the package.
lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy src
	$(MAKE) docs

# The docs site (mkdocs.yml): --strict, so a broken link or anchor fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python -m bench
	$(BIN)/python -m bench._report

# Peer projects for side-by-side benchmarks live in their own venv, never in .venv; llama.cpp's
# own server (bench/llama_server.py) is a binary in the cache, built by `make llama-server`.
peers: llama-server
	test -d .venv-peers || $(PY) -m venv .venv-peers
	.venv-peers/bin/pip install -q -c constraints.txt torch agentlightning==0.3.0 'ray[default]' omegaconf hydra-core \
		numpy pyyaml aiohttp requests filelock packaging sortedcontainers
	.venv-peers/bin/pip install -q --no-deps rlinf==0.3.0

# llama-server (and llama-batched-bench, the bare-decode ceiling) from the very llama.cpp that
# llama-cpp-python==<pinned> vendors: its sdist, the same CPU flags as the wheel above, static,
# no UI, no HTTPS, cmake fetches nothing. About 9 minutes on 2 busy cores, so not part of
# install or test; the binaries stay in the cache and the target skips when they are there.
LLAMA_PY_VERSION := $(shell sed -n 's/^llama-cpp-python==//p' constraints.txt)
LLAMA_CACHE ?= $(or $(ROLLFLEET_CACHE),$(HOME)/.cache/rollfleet)
LLAMA_SRC := $(LLAMA_CACHE)/src/llama-cpp-python-$(LLAMA_PY_VERSION)
LLAMA_SERVER := $(LLAMA_CACHE)/bin/llama-server
LLAMA_SERVER_CMAKE := $(LLAMA_CMAKE) -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
	-DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF

llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER):
	test -n "$(LLAMA_PY_VERSION)"  # constraints.txt pins llama-cpp-python
	mkdir -p $(LLAMA_SRC) $(LLAMA_CACHE)/bin
	ls $(LLAMA_SRC)/llama_cpp_python-*.tar.gz >/dev/null 2>&1 || $(PY) -m pip download -q \
		--no-binary :all: --no-deps -d $(LLAMA_SRC) llama-cpp-python==$(LLAMA_PY_VERSION)
	test -f $(LLAMA_SRC)/tree/vendor/llama.cpp/CMakeLists.txt || { rm -rf $(LLAMA_SRC)/tree && \
		mkdir $(LLAMA_SRC)/tree && tar -xzf $(LLAMA_SRC)/llama_cpp_python-*.tar.gz -C $(LLAMA_SRC)/tree \
		--strip-components=1; }
	nice -n 10 cmake -S $(LLAMA_SRC)/tree/vendor/llama.cpp -B $(LLAMA_SRC)/build $(LLAMA_SERVER_CMAKE)
	nice -n 10 cmake --build $(LLAMA_SRC)/build --target llama-server llama-batched-bench -j2
	install -m 755 $(LLAMA_SRC)/build/bin/llama-batched-bench $(LLAMA_CACHE)/bin/
	install -m 755 $(LLAMA_SRC)/build/bin/llama-server $(LLAMA_SERVER)

clean:
	rm -rf $(VENV) .venv-peers .rollfleet build *.egg-info
