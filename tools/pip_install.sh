#!/usr/bin/env bash
# One `pip install` step of `make build` (tools/bootstrap.sh and the Makefile call it): it says what it is
# doing, shows progress while it runs, keeps pip's whole output in a log file, and fails loudly. A failed pip
# makes this script exit with pip's status and print the end of pip's output (the error), never a silent
# success.
#
#   tools/pip_install.sh [--label TEXT] [--log FILE] [--progress REGEX] PYTHON PIP_INSTALL_ARGS...
#
#   --label     what the step is, printed at its start and end (default: "pip install ARGS")
#   --log       where pip's full output goes (default: a new file under $TMPDIR)
#   --progress  an extended regex: output lines that match are printed while pip runs (e.g. ninja's
#               "[12/80] Building CXX object ..." with pip -v). Default: pip's own milestones
#               (Collecting, Processing, Installing, Successfully installed).
set -euo pipefail

label=""
log=""
progress='^(Collecting|Processing|Installing collected|Successfully installed|Building wheel|Created wheel)'
while (($#)); do
  case "$1" in
    --label) label="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    --progress) progress="$2"; shift 2 ;;
    *) break ;;
  esac
done
if (($# < 2)); then
  echo "usage: $0 [--label TEXT] [--log FILE] [--progress REGEX] PYTHON PIP_INSTALL_ARGS..." >&2
  exit 2
fi
python="$1"
shift
label="${label:-pip install $*}"
if [[ -z "$log" ]]; then
  log="$(mktemp -t ettkit-pip-XXXXXX.log)"
else
  mkdir -p "$(dirname "$log")"
fi

start=$SECONDS
echo "$label: started (full output: $log)"
# pip's status is PIPESTATUS[0]; the filter's (grep finds nothing: 1) must not count. Progress lines are
# indented and cut to one terminal line.
set +e
"$python" -m pip install --disable-pip-version-check "$@" 2>&1 | tee "$log" |
  { grep --line-buffered -E -- "$progress" | sed -u -E 's/^[[:space:]]*/  /; s/^(.{150}).+/\1/'; true; }
rc=${PIPESTATUS[0]}
set -e
elapsed=$((SECONDS - start))
if ((rc != 0)); then
  {
    echo "$label: FAILED (pip exit status $rc, after ${elapsed} s). The end of pip's output:"
    tail -n 40 "$log" | sed 's/^/  | /'
    echo "$label: the full output is in $log"
  } >&2
  exit "$rc"
fi
echo "$label: done in ${elapsed} s"
