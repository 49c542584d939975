# ettkit's entry points. Everything works from a clean clone on a fresh Debian 12 machine and is
# idempotent: a second `make build` installs and rebuilds nothing.
#   make build     Debian packages + .venv (torch, Python deps) + build and install ettkit into .venv
#   make test      build, then the C++ tests (ctest) and the Python tests (pytest); both summaries printed
#   make demo      the main job: one sharded training job, the plain PyTorch way and with ettkit, each killed once
#                  and restarted; both ETT reports side by side (docs/demo.md)
#   make bench     every benchmark with --quick; JSON into build/bench/
#   make sanitize  the C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

VENV := .venv
PY := $(abspath $(VENV))/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)
BUILD_DIR := build/py
STAMP := $(BUILD_DIR)/.ettkit-installed
SOURCES := $(shell find CMakeLists.txt pyproject.toml cmake include src python tests/cpp benchmarks/cpp \
             -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.in' -o -name '*.txt' -o -name '*.cmake' \
             -o -name '*.py' -o -name '*.toml' \) 2>/dev/null)
JOBS ?= $(shell nproc)

.PHONY: build bootstrap test test-cpp test-python demo bench sanitize clean

bootstrap:
	@tools/bootstrap.sh

build: bootstrap $(STAMP)

# Builds the wheel with the C++ tests and benchmarks enabled in the same CMake build directory, so ctest
# and the benchmarks reuse the objects of the installed library instead of compiling everything twice.
$(STAMP): $(SOURCES) | bootstrap
	@echo "build: compiling and installing ettkit into $(VENV)"
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install -q --disable-pip-version-check --no-build-isolation \
	  --no-deps --force-reinstall -Cbuild-dir=$(BUILD_DIR) -Ccmake.define.ETTKIT_BUILD_TESTS=ON \
	  -Ccmake.define.ETTKIT_BUILD_BENCHMARKS=ON . 2>&1 | grep -v "is ignored: it is neither" || true
	@$(PY) -c "import ettkit; print('build: ettkit', ettkit.__version__, 'CUDA code paths:', ettkit.WITH_CUDA)"
	@touch $@

test: build
	@rc=0; \
	echo "==== C++ tests (ctest) ===="; \
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) || rc=1; \
	echo "==== Python tests (pytest) ===="; \
	$(PY) -m pytest tests/python -q -p no:cacheprovider || rc=1; \
	exit $$rc

test-cpp: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

test-python: build
	$(PY) -m pytest tests/python -q -p no:cacheprovider

demo: build
	$(PY) examples/python/ett_demo.py --out build/demo

bench: build
	@mkdir -p build/bench
	@for f in benchmarks/*.py; do \
	  name=$$(basename $$f .py); \
	  [[ $$name == bench_common ]] && continue; \
	  echo "==== $$name ===="; \
	  $(PY) $$f --quick --json build/bench/$$name.json; \
	done

# A separate instrumented build of the C++ tests (the library and the tests; torch itself is not).
sanitize: bootstrap
	cmake -S . -B build/asan -G Ninja -DPython_EXECUTABLE=$(PY) -DETTKIT_SANITIZE=ON \
	  -DETTKIT_BUILD_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build build/asan -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir build/asan --output-on-failure -j $(JOBS)

clean:
	rm -rf build
