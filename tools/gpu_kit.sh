#!/usr/bin/env bash
# `make gpu-kit`: everything a lent GPU machine needs to build, test and benchmark ettkit beyond its own image
# (torch 2.11 + CUDA 13, Python 3.12, nvcc, cmake, ninja; no package registry), in the git-ignored .gpu/:
#
#   .gpu/prefix/usr/   the Debian 12 packages of the C++ dependencies (spdlog, fmt, GoogleTest/GoogleMock,
#                      google-benchmark, nlohmann-json, xxHash, and their -dev parts), `apt-get download`ed and
#                      unpacked with `dpkg -x` here (never into /); docs dropped, .pc files made relocatable
#   .gpu/wheels/       wheels for CPython 3.12 / manylinux x86-64 of what the build and the GPU tests import
#                      besides torch (gpu_check.sh installs only those the device lacks)
#   .gpu/gpu_check.sh  copies of tools/gpu_check.sh and tools/gpu_report.py, for a checkout that predates them
#   .gpu/gpu_report.py
#   .gpu/MANIFEST.txt  what is in the kit, with versions and sizes
#
# Idempotent: a second run with the same inputs (this script and the package lists below) downloads nothing.
# The .deb files are cached in build/gpu-kit/debs, outside the kit, so only the unpacked prefix travels.
# The device runs it as: tools/gpu_check.sh (docs/benchmarks.md, "GPU").
set -euo pipefail
cd "$(dirname "$0")/.."

KIT=.gpu
DEB_CACHE=build/gpu-kit/debs
# The runtime packages travel too: the -dev packages' CMake configs reference their shared libraries, even
# though gpu_check.sh builds spdlog/fmt header-only and xxHash inline (ETTKIT_HEADER_ONLY_DEPS=ON).
DEBS=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libgtest-dev libgmock-dev libbenchmark-dev
      libbenchmark1debian nlohmann-json3-dev libxxhash-dev libxxhash0)
# What the build (scikit-build-core, ninja; pybind11 comes with torch's headers) and the GPU tests and benchmarks (pytest, safetensors,
# numpy) import besides torch. The device image has all of them today; these are the fallback. cmake is not
# here (its wheel alone is ~30 MB and the image has it).
WHEELS=('scikit-build-core>=0.10' ninja pytest safetensors numpy)
PIP_TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
MAX_MIB=48   # the device tool carries 64 MiB in all, the work tree included

want_stamp=$( { cat "$0"; printf '%s\n' "${DEBS[@]}" "${WHEELS[@]}"; } | sha256sum | cut -c1-16)
if [[ -f $KIT/.stamp && $(cat $KIT/.stamp) == "$want_stamp" && -d $KIT/prefix && -d $KIT/wheels ]]; then
  for f in gpu_check.sh gpu_report.py; do cmp -s tools/$f $KIT/$f || cp tools/$f $KIT/$f; done
  echo "gpu-kit: $KIT is up to date ($(du -sh --apparent-size $KIT | cut -f1))"
  exit 0
fi

rm -rf "$KIT.tmp" && mkdir -p "$KIT.tmp/wheels" "$DEB_CACHE"

# ---- Debian packages -----------------------------------------------------------------------------------------
missing=()
for p in "${DEBS[@]}"; do
  compgen -G "$DEB_CACHE/${p}_*.deb" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "gpu-kit: apt-get download ${missing[*]}"
  # apt-get download needs the package lists; a fresh machine may have none yet.
  if ! apt-cache show "${missing[0]}" >/dev/null 2>&1; then apt-get update -qq; fi
  # apt's sandbox user cannot write into the work tree: download as the caller (the warning is harmless).
  (cd "$DEB_CACHE" && apt-get download -q -o APT::Sandbox::User=root "${missing[@]}" 2>&1 | grep -v '^Get:' || true)
fi
for p in "${DEBS[@]}"; do
  deb=$(compgen -G "$DEB_CACHE/${p}_*.deb" | sort | tail -1) || { echo "gpu-kit: $p was not downloaded" >&2; exit 1; }
  dpkg -x "$deb" "$KIT.tmp/prefix"
  echo "deb $(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version)" >>"$KIT.tmp/MANIFEST.txt"
done
rm -rf "$KIT.tmp/prefix/usr/share/doc" "$KIT.tmp/prefix/usr/share/man" "$KIT.tmp/prefix/usr/src"
# pkg-config files say prefix=/usr; ${pcfiledir} makes them valid wherever the kit is unpacked.
for pc in "$KIT.tmp"/prefix/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc "$KIT.tmp"/prefix/usr/share/pkgconfig/*.pc; do
  [[ -f $pc ]] || continue
  rel=$(realpath --relative-to="$(dirname "$pc")" "$KIT.tmp/prefix/usr")
  sed -i "s|^prefix=/usr\$|prefix=\${pcfiledir}/$rel|" "$pc"
done

# ---- wheels for the device's CPython 3.12 --------------------------------------------------------------------
echo "gpu-kit: pip download ${WHEELS[*]} (CPython 3.12, manylinux x86-64)"
pip_quiet() {  # pip, without the warnings about this machine's local index folders; pip's exit status
  local out rc
  out=$(python3 -m pip "$@" 2>&1); rc=$?
  [[ -z $out ]] || grep -v "is ignored: it is neither" <<<"$out" || true
  return $rc
}
pip_quiet download -q --disable-pip-version-check "${PIP_TARGET[@]}" -d "$KIT.tmp/wheels" "${WHEELS[@]}"
for w in "${WHEELS[@]}"; do
  name=$(echo "$w" | sed 's/[<>=!].*//; s/-/_/g')
  compgen -G "$KIT.tmp/wheels/${name}-*.whl" >/dev/null || { echo "gpu-kit: no wheel for $w" >&2; exit 1; }
done
# One version of each distribution: two would stop the whole install on the device.
dups=$(ls "$KIT.tmp/wheels" | sed 's/-.*//' | tr '[:upper:]' '[:lower:]' | sort | uniq -d)
[[ -z $dups ]] || { echo "gpu-kit: more than one wheel of: $dups" >&2; exit 1; }
# The set must resolve offline, for 3.12, from nothing but itself.
check_dir=$(mktemp -d)
pip_quiet download -q --disable-pip-version-check --no-index --find-links "$KIT.tmp/wheels" "${PIP_TARGET[@]}" \
  -d "$check_dir" "${WHEELS[@]}" || { echo "gpu-kit: the wheels do not resolve offline for CPython 3.12" >&2; exit 1; }
rm -rf "$check_dir"
for f in "$KIT.tmp"/wheels/*.whl; do echo "wheel $(basename "$f")" >>"$KIT.tmp/MANIFEST.txt"; done

cp tools/gpu_check.sh tools/gpu_report.py "$KIT.tmp/"
echo "$want_stamp" >"$KIT.tmp/.stamp"
rm -rf "$KIT" && mv "$KIT.tmp" "$KIT"

size_kib=$(du -sk --apparent-size "$KIT" | cut -f1)
{
  echo "# ettkit GPU kit, made $(date -u +%FT%TZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), glibc $(ldd --version | head -1 | awk '{print $NF}')"
  echo "# size $((size_kib / 1024)) MiB; carried to the device with run(carry=['.gpu'])"
  echo "# run-time needs of the shared libraries here: glibc >= 2.34 (libspdlog; 2.32 libbenchmark, 2.33 libfmt),"
  echo "# libstdc++ with GLIBCXX_3.4.30 (GCC 12); gpu_check.sh builds ettkit without them (ETTKIT_HEADER_ONLY_DEPS)"
  echo "# and needs only libbenchmark, for the C++ benchmark binary; libgtest/libgmock are static archives"
} | cat - "$KIT/MANIFEST.txt" >"$KIT/MANIFEST.tmp" && mv "$KIT/MANIFEST.tmp" "$KIT/MANIFEST.txt"
if ((size_kib > MAX_MIB * 1024)); then
  echo "gpu-kit: $KIT is $((size_kib / 1024)) MiB, over the $MAX_MIB MiB this kit may take of the 64 MiB the device tool carries" >&2
  exit 1
fi
echo "gpu-kit: wrote $KIT: $(du -sh --apparent-size "$KIT" | cut -f1) (prefix $(du -sh --apparent-size "$KIT/prefix" | cut -f1), wheels $(du -sh --apparent-size "$KIT/wheels" | cut -f1))"
