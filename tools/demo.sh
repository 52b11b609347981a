#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the main job. Extra arguments go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec "${UCP_VENV:-.venv}/bin/ucp" demo "$@"
