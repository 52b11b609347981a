#!/usr/bin/env bash
# Set up (tools/setup.sh --test) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh --test
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Tests run on pytest-xdist workers, one per core up to 4 (UCP_TEST_WORKERS overrides; 0 runs them in
# this process): most of the suite waits on child processes, sleeps and the disk, so two workers on
# the 2-core CI machine take 6 minutes where one took 11.
workers=${UCP_TEST_WORKERS:-auto}
dist=(-n "$workers")
[ "$workers" = auto ] && dist+=(--maxprocesses 4)
exec "${UCP_VENV:-.venv}/bin/python" -m pytest -q "${dist[@]}" "$@"
