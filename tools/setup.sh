#!/usr/bin/env bash
# Set up UCP in ./.venv on a fresh machine: Debian's libaio (and fio for the
# benchmarks) when root, a venv, torch (kept if the interpreter already has one,
# else the CPU wheel torch==2.13.0 before anything else asks pip for a CUDA
# build), then the project itself. Idempotent: a second run installs nothing new.
#   tools/setup.sh           runtime + CLI
#   tools/setup.sh --test    also the test extras
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${UCP_VENV:-.venv}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

have_lib() { ldconfig -p 2>/dev/null | grep -q "$1"; }
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  have_lib 'libaio.so.1' || need+=("$(apt-cache show libaio1t64 >/dev/null 2>&1 && echo libaio1t64 || echo libaio1)")
  command -v fio >/dev/null || need+=(fio)
  if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${need[*]}"
    (apt-get install -y -qq "${need[@]}" >/dev/null 2>&1) || { apt-get update -qq >/dev/null && apt-get install -y -qq "${need[@]}" >/dev/null; } \
      || echo "setup: could not install ${need[*]}; the libaio engine falls back to threads"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c 'import torch' 2>/dev/null; then
    echo "setup: keeping the interpreter's torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"$VENV/bin/python" -c 'import torch' 2>/dev/null || "${PIP[@]}" torch==2.13.0
stamp="$VENV/.ucp-installed${extras:+-test}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  "${PIP[@]}" -e ".$extras"
  if [ -n "$extras" ]; then
    # The peer the tests compare against. DeepSpeed ships as an sdist whose build must see the
    # installed torch (no isolation) and must not compile its C++ ops (CPU-only machine).
    DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation deepspeed==0.19.8 huggingface_hub \
      || echo "setup: DeepSpeed could not be installed; the peer tests will be skipped"
  fi
  touch "$stamp"
fi
# Byte-compile the project, as a (non-editable) pip install does: the editable install never writes its
# .pyc files when PYTHONDONTWRITEBYTECODE is set (as on our machines), and every `ucp` command would then
# compile its modules from source on each start (0.1-0.2 s of a one-shot command; docs/benchmarks.md).
# Incremental: only files changed since the last run are compiled again.
"$VENV/bin/python" -m compileall -q -j 0 aio gds reshard ucp training kernels >/dev/null \
  || echo "setup: some modules did not byte-compile; they are compiled from source when imported"
