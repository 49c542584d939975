#!/usr/bin/env bash
# Runs the quickstart restart test (examples/python/quickstart.py under torchrun, a SIGKILL of rank 1 at a
# seeded random step) N times in a row, each with its own seed, and prints the pass count. Not in CI: each run
# takes 1.5-3 minutes on the 2-core machine.  Usage: tools/quickstart_soak.sh [N=10] [FIRST_SEED=random]
set -u
cd "$(dirname "$0")/.."
n=${1:-10}
seed=${2:-$RANDOM}
passed=0
for ((i = 0; i < n; i++)); do
  if QUICKSTART_SEED=$((seed + i)) nice -n 10 .venv/bin/python -m pytest \
      tests/python/test_quickstart.py -q -p no:cacheprovider -s -k bit_for_bit >"/tmp/quickstart_soak.$i.log" 2>&1; then
    passed=$((passed + 1)); echo "run $i (seed $((seed + i))): pass"
  else
    echo "run $i (seed $((seed + i))): FAIL, log in /tmp/quickstart_soak.$i.log"
  fi
done
echo "quickstart soak: $passed/$n passed"
[ "$passed" -eq "$n" ]
