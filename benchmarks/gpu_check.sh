#!/usr/bin/env bash
# The GPU check: matmul MFU per dtype, then cs336-small and cs336-medium at ctx 1024 for ~30 steps in
# bf16-mixed + compile, bf16-true + compile and fp8 (torchao / Transformer Engine) where available.
# Finishes in < 8 minutes on one H100/H200; prints a short table last, full results in the results dir.
#
#   [PYTHON=/path/to/python] bash benchmarks/gpu_check.sh [--dry-run] [--out DIR] [--steps N] [--budget SECONDS]
#
# --dry-run (or a machine without CUDA) runs every stage at toy size on the CPU. Runs from a source
# checkout without installing: wheels of packages the GPU machine lacks (jsonargparse and its
# [signatures] extras; torchao for the fp8 row) may sit in .whl/ and are installed to a temp dir.
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter is explicit: $PYTHON, else the checkout's .venv, else python3 (a GPU image's, with torch).
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  site="${TMPDIR:-/tmp}/lmledger-site"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_check.py "$@"
