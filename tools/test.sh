#!/usr/bin/env bash
# Set up (tools/setup.sh --test) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh --test
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${UCP_VENV:-.venv}/bin/python" -m pytest -q "$@"
