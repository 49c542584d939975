#!/usr/bin/env bash
# One call on a lent GPU machine runs and measures every CUDA path of ettkit (issue #13):
#
#   here:        make gpu-kit                       (writes .gpu/: C++ deps, wheels, this script)
#   the device:  run(command="tools/gpu_check.sh", carry=[".gpu"], timeout_s=600)
#
# Steps, each with its own time limit inside one overall budget, each logged; a failing step does not stop the
# steps that do not need it, and the exit status is non-zero when any step failed or was skipped:
#   probe         nvidia-smi -q, OS, glibc, compilers, python, torch; FAILS when torch sees no CUDA device
#   wheels        installs the kit's wheels that this python lacks into a target dir (PYTHONPATH)
#   build         configures and builds ettkit against this python's torch (CUDA code paths ON) with the
#                 kit's C++ deps (CMAKE_PREFIX_PATH=.gpu/prefix/usr, spdlog/fmt/xxHash header-only), installs it
#                 into the target dir; the same build tree holds the C++ tests and benchmarks
#   ctest         every C++ test, ETTKIT_REQUIRE_CUDA=1 (a missing GPU or a skipped CUDA test fails)
#   pytest_cuda   the needs_cuda Python tests, ETTKIT_REQUIRE_CUDA=1
#   bench_*       the GPU benchmarks (checkpoint, ETT CUDA-event timer, sharding over NCCL, start-up compile)
#   batched_*     issue #65's batched CUDA copy path (StagerOptions::cuda_copy="batched", through ETTKIT_CUDA_COPY):
#                 the CUDA stager tests on it, then benchmarks/checkpoint.py's 256MB_small case (20,001 tensors)
#                 on it, with cudaMemcpyBatchAsync and with its fallback loop (ETTKIT_CUDA_MEMCPY_BATCH=0); each
#                 run has DCP's DefaultStager beside it, and bench_checkpoint has the old per-tensor path
#   report        gpu.json (docs/benchmarks.md layout), summary.md
#
# Output ($OUT when set, else build/gpu/; at most 8 files, which the device tool brings back):
#   gpu.json  summary.md  nvidia-smi-q.txt  gpu_check.log  logs.tar.gz (every step's log, the benchmarks'
#   JSON, the CMake and pytest files)
#
# Environment: ETTKIT_GPU_PYTHON (default python3: the device's torch), ETTKIT_GPU_BUDGET_S (default 570: the
# run tool allows 600 s a command), ETTKIT_GPU_WORK (default build/gpu-work), ETTKIT_GPU_WHEELS=all (install
# every kit wheel, not only the missing ones), ETTKIT_GPU_STEPS (a comma list to run only some steps),
# ETTKIT_GPU_QUICK=1 (benchmarks with --quick sizes), ETTKIT_GPU_CMAKE_DEFINES ("NAME=VALUE ..." for CMake),
# ETTKIT_GPU_TIME_SCALE (default 1: multiplies the budget and every step's limit, for a 2-core rehearsal).
# tools/gpu_check_dryrun.sh rehearses it on a machine without a GPU.
set -uo pipefail
export REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"   # tools/ or .gpu/: both sit in the repository root
cd "$REPO"

export KIT="$REPO/.gpu"
export OUT_DIR="${OUT:-$REPO/build/gpu}"
export WORK="${ETTKIT_GPU_WORK:-$REPO/build/gpu-work}"
export PY="${ETTKIT_GPU_PYTHON:-python3}"
export SITE="$WORK/site"
export BUILD="$WORK/build"
export LOGS="$WORK/logs"
export JOBS="$(nproc)"
export QUICK="${ETTKIT_GPU_QUICK:-0}"
TIME_SCALE="${ETTKIT_GPU_TIME_SCALE:-1}"   # multiplies every step's limit and the budget (a slow rehearsal)
BUDGET=$(( ${ETTKIT_GPU_BUDGET_S:-570} * TIME_SCALE ))
RESERVE=20   # kept back for the report and the archive
START=$(date +%s)
DEADLINE=$((START + BUDGET))

mkdir -p "$OUT_DIR" "$WORK"
rm -rf "$LOGS" "$WORK/bench" "$WORK/steps.tsv" && mkdir -p "$LOGS" "$WORK/bench"
exec > >(tee "$WORK/gpu_check.log") 2>&1

# The kit's C++ dependencies, found by CMake and pkg-config, and by the loader for the C++ benchmark binary
# (google-benchmark is a shared library in Debian; ettkit itself is built without any of them at run time).
export CMAKE_PREFIX_PATH="$KIT/prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
export PKG_CONFIG_PATH="$KIT/prefix/usr/lib/x86_64-linux-gnu/pkgconfig:$KIT/prefix/usr/share/pkgconfig"
export LD_LIBRARY_PATH="$KIT/prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export ETTKIT_LOG_LEVEL="${ETTKIT_LOG_LEVEL:-warn}"
# The CUDA toolkit: CUDA_HOME, else /usr/local/cuda (cmake/ettkitTorchHints.cmake looks there), else where the
# nvcc on PATH lives when a toolkit's headers sit beside it (an nvcc on PATH may be a wrapper script).
if [[ -z ${CUDA_HOME:-} && ! -x /usr/local/cuda/bin/nvcc ]]; then
  nvcc_path=$(command -v nvcc || true)
  cuda_root=${nvcc_path:+$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")}
  [[ -n $cuda_root && -f $cuda_root/include/cuda_runtime_api.h ]] && export CUDA_HOME="$cuda_root"
fi

# ---- the steps ------------------------------------------------------------------------------------------------
step_probe() {
  set -x
  if command -v nvidia-smi >/dev/null; then nvidia-smi -q >"$OUT_DIR/nvidia-smi-q.txt" 2>&1; nvidia-smi; else
    echo "nvidia-smi: not found" | tee "$OUT_DIR/nvidia-smi-q.txt"; fi
  cat /etc/os-release | head -4; uname -a; ldd --version | head -1
  gcc --version | head -1; g++ --version | head -1; nvcc --version | tail -2; cmake --version | head -1
  ninja --version; pkg-config --version; echo "CUDA_HOME=${CUDA_HOME:-}"; nproc; free -g | head -2; df -h "$WORK"
  set +x
  "$PY" - <<'EOF'
import json, os, sys
import torch
info = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_GiB=round(p.total_memory / 2**30, 1),
                sms=p.multi_processor_count)
    try:
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001 - informative only
        info["nccl"] = f"unknown ({type(e).__name__})"
print(json.dumps(info, indent=1))
with open(os.path.join(os.environ["WORK"], "probe.json"), "w") as f:
    json.dump(info, f)
if not info["cuda_available"]:
    sys.exit("probe: FAILED: torch sees no CUDA device (torch.cuda.is_available() is False): this is not a GPU "
             "machine, or the driver is not reachable")
EOF
}

step_wheels() {
  mkdir -p "$SITE"
  local want=()
  for whl in "$KIT"/wheels/*.whl; do
    [[ -f $whl ]] || { echo "wheels: $KIT/wheels is empty: run 'make gpu-kit' here first"; return 1; }
    local dist=${whl##*/}; dist=${dist%%-*}
    if [[ ${ETTKIT_GPU_WHEELS:-} == all ]] || ! "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
      want+=("$whl")
    else
      echo "wheels: $dist $("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist") is installed: kept"
    fi
  done
  if ((${#want[@]})); then
    echo "wheels: installing into $SITE: ${want[*]##*/}"
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${want[@]}" || return 1
  fi
  # The target dir's console scripts (ninja) for CMake.
  [[ -d $SITE/bin ]] && export PATH="$SITE/bin:$PATH"
  "$PY" -c "import scikit_build_core, pytest, safetensors, numpy; print('wheels: imports ok; pytest', pytest.__version__)"
}

step_build() {
  [[ -d $SITE/bin ]] && export PATH="$SITE/bin:$PATH"
  [[ -d $KIT/prefix/usr ]] || { echo "build: $KIT/prefix is missing: run 'make gpu-kit' here first"; return 1; }
  local extra=() d
  for d in ${ETTKIT_GPU_CMAKE_DEFINES:-}; do extra+=("-Ccmake.define.$d"); done
  # -Cbuild-dir keeps the CMake tree (with the C++ tests and benchmarks) for ctest, as `make build` does.
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PY" -m pip install -v --disable-pip-version-check --no-build-isolation \
    --no-deps --no-index --target "$SITE" --upgrade -Cbuild-dir="$BUILD" \
    -Ccmake.define.ETTKIT_BUILD_TESTS=ON -Ccmake.define.ETTKIT_BUILD_BENCHMARKS=ON \
    -Ccmake.define.ETTKIT_USE_CUDA=ON -Ccmake.define.ETTKIT_HEADER_ONLY_DEPS=ON \
    -Ccmake.define.CMAKE_PREFIX_PATH="$KIT/prefix/usr" -Ccmake.define.Python_EXECUTABLE="$(command -v "$PY")" \
    "${extra[@]}" "$REPO" || return 1
  # The C++ dependencies must have come from the kit, not from whatever the machine has.
  grep -E '^(spdlog|fmt|GTest|benchmark|nlohmann_json)_DIR' "$BUILD/CMakeCache.txt"
  local outside
  outside=$(grep -E '^(spdlog|fmt|GTest|benchmark|nlohmann_json)_DIR' "$BUILD/CMakeCache.txt" | grep -v "$KIT/prefix" || true)
  [[ -z $outside ]] || echo "build: NOTE: found outside the kit: $outside"
  cd "$WORK" && "$PY" -c "import ettkit; print('build: ettkit', ettkit.__version__, 'from', ettkit.__file__, 'CUDA code paths:', ettkit.WITH_CUDA); assert ettkit.WITH_CUDA, 'ettkit was built without CUDA'"
  # Header-only dependencies: libettkit.so must need none of the kit's libraries (torch's it finds through the
  # imported torch, which the target-dir layout puts elsewhere than its RUNPATH expects).
  if ldd "$SITE"/ettkit/lib/libettkit.so.*.*.* | grep -E 'spdlog|fmt|xxhash'; then
    echo "build: libettkit.so needs the libraries above: ETTKIT_HEADER_ONLY_DEPS did not take"; return 1
  fi
  return 0
}

step_ctest() {
  # ctest beside cmake, or from the cmake Python package when only that is installed.
  local ctest rc=0
  ctest=$(command -v ctest || "$PY" -c "import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, 'ctest'))")
  # A test that crashes leaves no trace in its output: keep its core (as root; the machine is ours for the
  # lease), to read its stack below with the image's debugger (cuda-gdb, which debugs host code too; there is
  # no gdb). %E: the executable's path, '/' written '!'.
  local cores="$WORK/cores"
  rm -rf "$cores" && mkdir -p "$cores"
  ulimit -c unlimited 2>/dev/null || true
  echo "$cores/core.%E.%p" >/proc/sys/kernel/core_pattern 2>/dev/null || echo "ctest: core_pattern not writable"
  ETTKIT_REQUIRE_CUDA=1 "$ctest" --test-dir "$BUILD" -j "$JOBS" --output-on-failure --timeout 180 \
    --output-junit "$WORK/ctest-junit.xml" ${ETTKIT_GPU_CTEST_REGEX:+-R "$ETTKIT_GPU_CTEST_REGEX"} || rc=$?
  local dbg core name cmd
  dbg=$(command -v cuda-gdb || command -v gdb || true)
  ((rc != 0)) && [[ -n $dbg ]] || return $rc
  echo "ctest: $(ls "$cores" | wc -l) core file(s) (death tests leave some too)"
  for name in $(grep -hoE 'Test +#[0-9]+: [A-Za-z0-9_./]+ \.+\*\*\*Exception' "$LOGS"/*-ctest.log | awk '{print $3}' | sort -u | head -3); do
    cmd=$("$ctest" --test-dir "$BUILD" -R "^${name}\$" --show-only=json-v1 | "$PY" -c '
import json, shlex, sys
print(shlex.join(json.load(sys.stdin)["tests"][0]["command"]))') || continue
    core=$(ls "$cores" | grep -F "core.$(echo "${cmd%% *}" | tr / !)." | head -1 || true)
    if [[ -n $core ]]; then
      echo "==== $name: the stack from its core ($core)"
      timeout 60 "$dbg" -q -batch -ex 'thread apply all bt 25' "${cmd%% *}" "$cores/$core" 2>&1 | tail -120
    else  # no core (the pattern could not be set): again, alone, under the debugger
      echo "==== $name: again under $(basename "$dbg")"
      ETTKIT_REQUIRE_CUDA=1 timeout 45 "$dbg" -q -batch -ex run -ex 'thread apply all bt 25' --args $cmd 2>&1 \
        | grep -vE '^\[(New|Thread .* exited)' | tail -120
    fi
  done
  return $rc
}

step_pytest_cuda() {
  ETTKIT_REQUIRE_CUDA=1 "$PY" -m pytest tests/python -m needs_cuda -p no:cacheprovider -q -rA \
    --junitxml="$WORK/pytest-cuda.xml"
}

bench_flags() { [[ $QUICK == 1 ]] && echo "--quick"; }

step_bench_checkpoint() {
  "$PY" benchmarks/checkpoint.py --device cuda $(bench_flags) --dir "$WORK/ckpt-bench" \
    --json "$WORK/bench/checkpoint.json"
}

# The batched path (issue #65) against the per-tensor one of bench_checkpoint, on the same machine in this call.
step_batched_ctest() {
  local ctest
  ctest=$(command -v ctest || "$PY" -c "import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, 'ctest'))")
  ETTKIT_CUDA_COPY=batched ETTKIT_REQUIRE_CUDA=1 "$ctest" --test-dir "$BUILD" -j "$JOBS" --output-on-failure \
    --timeout 120 -R 'Cuda|DeviceStager|Checkpointer[.]'
}

step_batched_bench() {
  ETTKIT_CUDA_COPY=batched "$PY" benchmarks/checkpoint.py --device cuda $(bench_flags) --cases 256MB_small \
    --dir "$WORK/ckpt-bench" --json "$WORK/bench/checkpoint_batched.json"
  ETTKIT_CUDA_COPY=batched ETTKIT_CUDA_MEMCPY_BATCH=0 "$PY" benchmarks/checkpoint.py --device cuda $(bench_flags) \
    --cases 256MB_small --dir "$WORK/ckpt-bench" --json "$WORK/bench/checkpoint_batched_loop.json"
}

step_bench_ett() {
  # The C++ half (ett_event_bench) is in this script's build tree, not in build/py where `make build` puts it.
  ETTKIT_BUILD_DIR="$BUILD" "$PY" benchmarks/ett_overhead.py --device cuda $(bench_flags) --json "$WORK/bench/ett_overhead.json"
}

step_bench_sharding() {
  "$PY" benchmarks/shard_metadata.py --device cuda --json "$WORK/bench/shard_metadata.json"
}

step_bench_startup() {
  "$PY" benchmarks/startup.py --device cuda $(bench_flags) --json "$WORK/bench/startup.json"
}

export -f step_probe step_wheels step_build step_ctest step_pytest_cuda step_bench_checkpoint step_bench_ett \
  step_bench_sharding step_bench_startup step_batched_ctest step_batched_bench bench_flags

# ---- the driver ------------------------------------------------------------------------------------------------
n=0
declare -A STATUS
run_step() {   # run_step NAME LIMIT_S [NEEDS...]: runs step_NAME under `timeout` with at most LIMIT_S seconds
  local name=$1 limit=$(($2 * TIME_SCALE)); shift 2
  n=$((n + 1))
  local log="$LOGS/$(printf %02d $n)-$name.log"
  if [[ -n ${ETTKIT_GPU_STEPS:-} && ",$ETTKIT_GPU_STEPS," != *",$name,"* ]]; then
    STATUS[$name]=skipped; printf '%s\t%s\t%s\t%s\t%s\n' "$name" skipped 0 "$limit" "not in ETTKIT_GPU_STEPS" >>"$WORK/steps.tsv"
    return
  fi
  local need
  for need in "$@"; do
    if [[ ${STATUS[$need]:-} != passed ]]; then
      STATUS[$name]=skipped
      echo "==== $name: SKIPPED ($need ${STATUS[$need]:-did not run})" | tee "$log"
      printf '%s\t%s\t%s\t%s\t%s\n' "$name" skipped 0 "$limit" "$need ${STATUS[$need]:-did not run}" >>"$WORK/steps.tsv"
      return
    fi
  done
  local left=$((DEADLINE - RESERVE - $(date +%s)))
  if ((left < 15)); then
    STATUS[$name]=skipped
    echo "==== $name: SKIPPED (the time budget of ${BUDGET}s is spent)" | tee "$log"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" skipped 0 "$limit" "time budget spent" >>"$WORK/steps.tsv"
    return
  fi
  ((limit > left)) && limit=$left
  echo "==== $name (limit ${limit}s, log $(basename "$log"))"
  local t0=$(date +%s%N) rc
  timeout -k 10 "$limit" bash -c "step_$name" >"$log" 2>&1
  rc=$?
  local secs=$(( ($(date +%s%N) - t0) / 1000000 ))e-3
  local status=passed note=""
  if ((rc == 124 || rc == 137)); then status=timeout; note="killed after ${limit}s"
  elif ((rc != 0)); then status=failed; note="exit $rc"; fi
  STATUS[$name]=$status
  printf '%s\t%s\t%.1f\t%s\t%s\n' "$name" "$status" "$secs" "$limit" "$note" >>"$WORK/steps.tsv"
  printf '     %s in %.1fs%s\n' "$status" "$secs" "${note:+ ($note)}"
  if [[ $status != passed ]]; then tail -n 25 "$log" | sed 's/^/     | /'; fi
}

echo "gpu_check: $(date -u +%FT%TZ), repo $REPO, python $PY, out $OUT_DIR, budget ${BUDGET}s"
run_step probe 60
run_step wheels 60
run_step build 330 wheels
run_step ctest 120 build
run_step pytest_cuda 150 build
run_step bench_checkpoint 150 build
run_step batched_ctest 60 build
run_step batched_bench 150 build
run_step bench_ett 60 build
run_step bench_sharding 60 build
run_step bench_startup 210 build

# ---- the report ---------------------------------------------------------------------------------------------------
"$PY" "$(dirname "${BASH_SOURCE[0]}")/gpu_report.py" --work "$WORK" --out "$OUT_DIR" --wall-s $(($(date +%s) - START)) \
  || echo "gpu_check: the report failed (the logs are still archived)"
rc=0
while IFS=$'\t' read -r name status _; do [[ $status == passed ]] || rc=1; done <"$WORK/steps.tsv"
[[ -f $OUT_DIR/gpu.json ]] || rc=1
echo "gpu_check: $( ((rc == 0)) && echo PASSED || echo FAILED) in $(($(date +%s) - START))s; see $OUT_DIR/summary.md"
cp "$WORK/gpu_check.log" "$OUT_DIR/gpu_check.log" 2>/dev/null
tar -C "$WORK" -czf "$OUT_DIR/logs.tar.gz" logs bench steps.tsv $(cd "$WORK" && ls probe.json ctest-junit.xml \
  pytest-cuda.xml 2>/dev/null) $(cd "$WORK" && ls build/CMakeCache.txt build/CMakeFiles/CMakeConfigureLog.yaml 2>/dev/null)
exit $rc
