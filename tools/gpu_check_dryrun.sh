#!/usr/bin/env bash
# Rehearses tools/gpu_check.sh on this machine (no GPU), as close to the device as a CPU machine gets:
#   - the C++ dependencies only from .gpu/: their Debian packages' headers, CMake files and libraries are
#     hidden in a private mount namespace (root only: `unshare -m`), and pkg-config is absent;
#   - "the device's python" is this repository's .venv (Python 3.11, torch 2.14.1+cu130; the device has 3.12
#     and 2.11.0+cu130): it has every package the kit's wheels hold, so none is installed (the kit's wheels
#     are checked for 3.12 by make gpu-kit);
#   - benchmarks with --quick sizes.
# Expected: wheels and build pass from the kit; probe, ctest, pytest_cuda and the benchmarks FAIL because
# there is no GPU (the gate: ETTKIT_REQUIRE_CUDA=1), and the exit status is non-zero.
#   make gpu-kit && tools/gpu_check_dryrun.sh        # output in build/gpu-dryrun/
#   ETTKIT_GPU_PYTHON=.venv-2.11/bin/python tools/gpu_check_dryrun.sh   # against the device's torch 2.11
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -d .gpu/prefix ]] || { echo "gpu_check_dryrun: run 'make gpu-kit' first" >&2; exit 1; }
export OUT="${OUT:-$PWD/build/gpu-dryrun}" ETTKIT_GPU_WORK="${ETTKIT_GPU_WORK:-$PWD/build/gpu-dryrun-work}"
export ETTKIT_GPU_PYTHON="${ETTKIT_GPU_PYTHON:-$PWD/.venv/bin/python}" ETTKIT_GPU_QUICK=1
# A build of everything takes 10-40 minutes on a 2-core machine against the device's 16 cores.
export ETTKIT_GPU_TIME_SCALE="${ETTKIT_GPU_TIME_SCALE:-15}"
export ETTKIT_GPU_CMAKE_DEFINES="PKG_CONFIG_EXECUTABLE=/nonexistent/pkg-config"
rm -rf "$OUT" && mkdir -p "$OUT"
exec unshare -m --propagation private bash -c '
  set -e
  empty=$(mktemp -d)
  A=/usr/lib/x86_64-linux-gnu
  for d in /usr/include/spdlog /usr/include/fmt /usr/include/nlohmann /usr/include/gtest /usr/include/gmock \
           /usr/include/benchmark $A/cmake/spdlog $A/cmake/fmt $A/cmake/GTest $A/cmake/benchmark \
           /usr/share/cmake/nlohmann_json; do
    [[ -d $d ]] && mount --bind "$empty" "$d"
  done
  for f in /usr/include/xxhash.h /usr/include/xxh3.h /usr/bin/pkg-config /usr/bin/pkgconf \
           $A/libspdlog.so* $A/libfmt.so* $A/libgtest*.a $A/libgmock*.a $A/libbenchmark* $A/libxxhash*; do
    [[ -e $f ]] && mount --bind /dev/null "$f"
  done
  exec tools/gpu_check.sh
'
