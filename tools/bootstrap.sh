#!/usr/bin/env bash
# Installs what ettkit needs on a fresh Debian 12 machine, idempotently: a second run installs nothing.
#   1. Debian packages (only the missing ones; `apt-get update` only when something is missing)
#   2. .venv at the repository root with torch (TORCH_VERSION, default the CUDA 13 build 2.14.1 so the
#      CUDA code paths compile) and requirements-dev.txt (re-run only when that file changes). The Makefile
#      sets VENV=.venv-X.Y for another TORCH_VERSION (2.11.0: the GPU machine's torch, a CUDA 13 build from
#      the package index, several GB with its nvidia-* wheels).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${TORCH_VERSION:-2.14.1}"
VENV="${VENV:-.venv}"
APT_PACKAGES=(build-essential pkg-config python3-venv python3-dev libspdlog-dev libgtest-dev libgmock-dev
              libbenchmark-dev nlohmann-json3-dev libxxhash-dev time)  # time: /usr/bin/time -v (ett_report_scale.py)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "bootstrap: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# Every install goes through tools/pip_install.sh: progress while it runs, pip's full output in
# build/logs/, and a failure that stops the build with pip's status and error.
pip_install() {
  local label="$1"
  shift
  tools/pip_install.sh --label "bootstrap: $label" --log "build/logs/bootstrap-${label%% *}.log" "$VENV/bin/python" "$@"
}

# The installed version from the package metadata, without importing torch (importing it before NumPy is
# installed prints NumPy warnings, and takes seconds).
installed_version() {
  "$VENV/bin/python" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}

torch_installed="$(installed_version torch)"
if [[ "${torch_installed%%+*}" != "$TORCH_VERSION" ]]; then
  pip_install "torch==$TORCH_VERSION (several GB for the CUDA build)" "torch==$TORCH_VERSION"
  echo "bootstrap: torch $(installed_version torch)"
fi

stamp="$VENV/.ettkit-deps-$(sha256sum requirements-dev.txt | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  pip_install "requirements-dev.txt" -r requirements-dev.txt
  rm -f "$VENV"/.ettkit-deps-*
  touch "$stamp"
fi

# TorchRec (CPU), for the tests and the benchmark that compare ettkit's sharding with TorchRec itself. Only
# for the default torch: these pins load against it (requirements-torchrec-cpu.txt says why --no-deps).
# ETTKIT_NO_TORCHREC=1 skips it; the tests that need TorchRec then skip, saying so.
if [[ "$TORCH_VERSION" == "2.14.1" && "${ETTKIT_NO_TORCHREC:-0}" != 1 ]]; then
  trec_stamp="$VENV/.ettkit-torchrec-$(sha256sum requirements-torchrec-cpu.txt | cut -c1-16)"
  if [[ ! -f "$trec_stamp" ]]; then
    pip_install "requirements-torchrec-cpu.txt (TorchRec for the comparison tests)" \
      --no-deps -r requirements-torchrec-cpu.txt
    rm -f "$VENV"/.ettkit-torchrec-*
    touch "$trec_stamp"
  fi
fi

# Lightning, transformers and accelerate, for ettkit's integrations and their tests (docs/integrations.md),
# for every torch: the integration tests import them unconditionally. --no-deps, so that pip never replaces
# torch (requirements-integrations-cpu.txt says why); the pins were resolved against torch 2.14.1 and declare
# torch>=2.1 (lightning) and >=2.6 (transformers, accelerate), so the GPU machine's 2.11 takes them too.
integ_stamp="$VENV/.ettkit-integrations-$(sha256sum requirements-integrations-cpu.txt | cut -c1-16)"
if [[ ! -f "$integ_stamp" ]]; then
  pip_install "requirements-integrations-cpu.txt (Lightning and transformers for the integration tests)" \
    --no-deps -r requirements-integrations-cpu.txt
  rm -f "$VENV"/.ettkit-integrations-*
  touch "$integ_stamp"
fi
