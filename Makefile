# ettkit's entry points. Everything works from a clean clone on a fresh Debian 12 machine and is
# idempotent: a second `make build` installs and rebuilds nothing.
#   make build     Debian packages + .venv (torch, Python deps) + build and install ettkit into .venv
#   make test      build, then the C++ tests (ctest) and the Python tests (pytest, in $(JOBS) worker processes;
#                  PYTEST_JOBS=0 for one); both summaries printed
#   make test-slow the same with the slow tests (pytest -m slow) included: a nightly run, not CI's
#   make demo      the main job: one sharded training job, the plain PyTorch way and with ettkit, each killed once
#                  and restarted; both ETT reports side by side (docs/demo.md)
#   make bench     every benchmark (a benchmarks/*.py with a __main__; the others are its modules) with
#                  --quick; JSON into build/bench/
#   make sanitize  the C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer
#   make tsan      the C++ tests under ThreadSanitizer
#   make asan-python  the Python tests of the checkpoint, recorder and start-up bindings, with the extension
#                  built under ASan + UBSan and the ASan runtime preloaded into CPython (docs/sanitizers.md)
#   make mutation-check  named one-line bugs in the integrity paths, each shown caught by its tests
#                  (mutation-check-ci: CI's subset)
#   make gpu-kit   .gpu/: what a lent GPU machine needs beyond its image to build, test and benchmark ettkit
#                  in one call of tools/gpu_check.sh (docs/benchmarks.md, "GPU")
# TORCH_VERSION=X.Y.Z (e.g. 2.11.0, the GPU machine's torch) builds and tests against that torch instead, in
# .venv-X.Y and build/py-X.Y, beside the default ones.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

DEFAULT_TORCH_VERSION := 2.14.1
TORCH_VERSION ?= $(DEFAULT_TORCH_VERSION)
ifeq ($(TORCH_VERSION),$(DEFAULT_TORCH_VERSION))
VENV := .venv
BUILD_DIR := build/py
else
TORCH_MINOR := $(word 1,$(subst ., ,$(TORCH_VERSION))).$(word 2,$(subst ., ,$(TORCH_VERSION)))
VENV := .venv-$(TORCH_MINOR)
BUILD_DIR := build/py-$(TORCH_MINOR)
endif
export TORCH_VERSION VENV
PY := $(abspath $(VENV))/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)
# The C++ test binaries of this build, for the tests that run them (test_cuda_gate.py).
export ETTKIT_BUILD_DIR := $(abspath $(BUILD_DIR))
STAMP := $(BUILD_DIR)/.ettkit-installed
SOURCES := $(shell find CMakeLists.txt pyproject.toml cmake include src python tests/cpp benchmarks/cpp \
             -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.in' -o -name '*.txt' -o -name '*.cmake' \
             -o -name '*.py' -o -name '*.toml' \) 2>/dev/null)
JOBS ?= $(shell nproc)
# pytest's worker processes (pytest-xdist), one test file per worker at a time (--dist loadfile: a file's
# module-scoped fixtures, such as the demo run and the C++ example's build, run once). On the project's
# 2-core VM two workers took the suite from 1,079 s to 823 s (docs/benchmarks.md, "CI"). 0: in-process.
PYTEST_JOBS ?= $(JOBS)
PYTEST_PARALLEL := -n $(PYTEST_JOBS) --dist loadfile

.PHONY: build bootstrap test test-cpp test-python demo bench sanitize tsan asan-python gpu-kit clean

bootstrap:
	@tools/bootstrap.sh

build: bootstrap $(STAMP)

# Builds the wheel with the C++ tests and benchmarks enabled in the same CMake build directory, so ctest
# and the benchmarks reuse the objects of the installed library instead of compiling everything twice. The
# test files are compiled -O1 (the library keeps Release's -O3): they only call into it, and -O3 spent its
# time inlining gtest's templates.
# pip -v passes CMake's and ninja's output through: ninja's "[n/N] Building ..." lines are the progress shown;
# everything is in build/logs/ettkit-install.log, and a failure prints its end and stops make.
$(STAMP): $(SOURCES) | bootstrap
	@CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) tools/pip_install.sh --label "build: compiling and installing ettkit into $(VENV)" \
	  --log build/logs/ettkit-install.log --progress '^[[:space:]]*\[[0-9]+/[0-9]+\] |^-- Configuring done|CMake Error' \
	  $(PY) -v --no-build-isolation --no-deps --force-reinstall -Cbuild-dir=$(BUILD_DIR) \
	  -Ccmake.define.ETTKIT_BUILD_TESTS=ON -Ccmake.define.ETTKIT_BUILD_BENCHMARKS=ON \
	  -Ccmake.define.ETTKIT_TEST_COMPILE_OPTIONS=-O1 .
	@$(PY) -c "import ettkit; print('build: ettkit', ettkit.__version__, 'CUDA code paths:', ettkit.WITH_CUDA)"
	@touch $@

test: build
	@rc=0; \
	echo "==== C++ tests (ctest) ===="; \
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) || rc=1; \
	echo "==== Python tests (pytest) ===="; \
	$(PY) -m pytest tests/python -q -p no:cacheprovider $(PYTEST_PARALLEL) --durations=25 || rc=1; \
	exit $$rc

# The nightly-style run: what `make test` runs plus the slow tests it deselects (the 100 mid-save SIGKILLs of
# test_checkpoint_crash.py, the 300 s decoder fuzz; a bounded part of each runs in make test). The later -m
# overrides pyproject's -m 'not slow'.
.PHONY: test-slow
test-slow: build
	@rc=0; \
	echo "==== C++ tests (ctest) ===="; \
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) || rc=1; \
	echo "==== Python tests, the slow ones included (pytest) ===="; \
	$(PY) -m pytest tests/python -q -p no:cacheprovider $(PYTEST_PARALLEL) -m "slow or not slow" --durations=25 || rc=1; \
	exit $$rc

test-cpp: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

test-python: build
	$(PY) -m pytest tests/python -q -p no:cacheprovider $(PYTEST_PARALLEL)

demo: build
	$(PY) examples/python/ett_demo.py --out build/demo

bench: build
	@mkdir -p build/bench
	@for f in benchmarks/*.py; do \
	  name=$$(basename $$f .py); \
	  grep -q '^if __name__ == "__main__":' $$f || continue; \
	  echo "==== $$name ===="; \
	  $(PY) $$f --quick --json build/bench/$$name.json; \
	done

# Separate instrumented builds, one per sanitizer (the library, its tests and the Python module; torch, spdlog
# and gtest are not instrumented). docs/sanitizers.md explains every option below.
# Stress and randomized tests run ETTKIT_TEST_SCALE times their trials: the same kinds of test, fewer rounds.
# -O1 -g1 (line tables): what the sanitizers' own docs recommend for readable reports, and it compiles 2.4x
# faster than RelWithDebInfo's -O2 -g (checkpointer.cpp under ASan: 81 s against 191 s on the 2-core VM).
# The library keeps -O1 -g1, compiled as a unity build (8 sources per translation unit); the test files are
# compiled -O0 -g0 and the Python module -g0 (their reports still name the function; line tables for
# pybind11's and gtest's templates were most of the compile time), and ctest runs each test binary once,
# not once per test (docs/sanitizers.md, "CI time").
SAN_CMAKE := -G Ninja -DPython_EXECUTABLE=$(PY) -DETTKIT_BUILD_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  '-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG' '-DETTKIT_TEST_COMPILE_OPTIONS=-O0;-g0' \
  -DETTKIT_CTEST_PER_TEST=OFF '-DETTKIT_PYTHON_COMPILE_OPTIONS=-g0' -DETTKIT_UNITY_LIBRARY=ON
# `sanitize` and `asan-python` share one ASan + UBSan build (build/asan: the library, the C++ tests and the
# Python module), so CI compiles the instrumented library once.
ASAN_CMAKE := $(SAN_CMAKE) -DETTKIT_SANITIZE=address -DETTKIT_BUILD_PYTHON=ON -DETTKIT_BUILD_TESTS=ON
sanitize: bootstrap
	cmake -S . -B build/asan $(ASAN_CMAKE) >/dev/null
	cmake --build build/asan -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir build/asan --output-on-failure -j $(JOBS)

# A TSan report makes the test's process exit 66, so ctest fails it. tools/tsan.supp holds the (third-party
# only) suppressions, each explained. OMP_NUM_THREADS=1: ATen runs a large tensor op on libgomp's threads,
# which are not instrumented, so TSan sees their writes but not the barrier that orders them (reports inside
# at::TensorIterator from a test building an 8 MiB tensor); ettkit's own threads are unaffected.
TSAN_OPTIONS_ETTKIT := suppressions=$(abspath tools/tsan.supp) second_deadlock_stack=1 exitcode=66
tsan: bootstrap
	cmake -S . -B build/tsan $(SAN_CMAKE) -DETTKIT_SANITIZE=thread >/dev/null
	cmake --build build/tsan -j $(JOBS)
	OMP_NUM_THREADS=1 ETTKIT_TEST_SCALE=0.3 TSAN_OPTIONS="$(TSAN_OPTIONS_ETTKIT)" \
	  ctest --test-dir build/tsan --output-on-failure -j $(JOBS)

# The extension (ettkit._C + libettkit.so) of build/asan, imported by the venv's own (uninstrumented)
# CPython with the ASan runtime preloaded. build/pyasan/site/ettkit is the package: the Python sources plus
# the instrumented module, found first on PYTHONPATH. libstdc++ is preloaded right after the ASan runtime: CPython
# does not link it, and ASan resolves its __cxa_throw interceptor at start-up, so without it the first C++
# exception thrown by any extension (triton's, while torch imports it) fails an ASan CHECK. Reports go to files (log_path), so that one from a
# subprocess whose exit status a test expects to be non-zero still fails the target.
ASAN_PY_TESTS := tests/python/test_checkpoint.py tests/python/test_checkpoint_integrity.py \
  tests/python/test_checkpoint_lifecycle.py tests/python/test_checkpoint_hardening.py \
  tests/python/test_ett_recorder.py tests/python/test_startup_stages.py
ASAN_PY_LOGS := $(abspath build/pyasan/reports)
asan-python: bootstrap
	cmake -S . -B build/asan $(ASAN_CMAKE) >/dev/null
	cmake --build build/asan -j $(JOBS) --target ettkit_python
	@rm -rf build/pyasan && mkdir -p build/pyasan/site/ettkit $(ASAN_PY_LOGS)
	@for f in python/ettkit/*; do ln -s $(abspath .)/$$f build/pyasan/site/ettkit/; done
	@ln -s $(abspath build/asan)/python/csrc/_C*.so build/pyasan/site/ettkit/
	@rc=0; \
	PYTHONPATH=$(abspath build/pyasan/site) LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" PYTHONMALLOC=malloc \
	ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0:log_path=$(ASAN_PY_LOGS)/asan \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(ASAN_PY_LOGS)/ubsan ETTKIT_TEST_SCALE=0.1 \
	  $(PY) -m pytest $(ASAN_PY_TESTS) -q -p no:cacheprovider -x || rc=1; \
	if compgen -G "$(ASAN_PY_LOGS)/*" >/dev/null; then \
	  echo "asan-python: sanitizer reports:"; cat $(ASAN_PY_LOGS)/*; rc=1; \
	fi; exit $$rc

# Idempotent; prints the kit's size (the device tool carries at most 64 MiB, the work tree included).
gpu-kit:
	@tools/gpu_kit.sh

clean:
	rm -rf build

# Named one-line bugs in the integrity paths (the chunk checks of a load, the prefetch, a resharding load,
# the memory tier, the peer replica's give-back, the commit vote, the fused digest) and the security checks
# (the memory tier's trust rules, the compile cache's MACs, the .extra decoder's limits), each applied to a
# copy of its one file (C++: compiled with build/py's own command and relinked into build/mutation, test
# binaries that compile the file themselves too; Python: in build/mutation/site); the tests named for it must fail
# (tools/mutation_check.py; docs/sanitizers.md, "Mutation check"). MUTATIONS="a b": those only (--list).
.PHONY: mutation-check
mutation-check: build
	$(PY) tools/mutation_check.py --build-dir $(BUILD_DIR) --json build/mutation-check.json \
	  $(if $(MUTATIONS),--only $(MUTATIONS))

# CI's part of it (.ci/run, after make test, on the same build/py): the subset that compiles fastest, one
# mutation per integrity layer, the fused digest and a memory-tier trust check (tools/mutation_check.py's
# CI_SUBSET; 44 s on the idle 2-core VM, up to about 2.5 minutes beside other builds, docs/sanitizers.md).
.PHONY: mutation-check-ci
mutation-check-ci: build
	$(PY) tools/mutation_check.py --build-dir $(BUILD_DIR) --json build/mutation-check-ci.json --ci
