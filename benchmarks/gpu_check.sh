#!/usr/bin/env bash
# The GPU check: matmul MFU per dtype; cs336-medium and cs336-small at ctx 1024 for a few dozen steps, eager and
# compiled, in bf16 and fp8 (torchao / Transformer Engine) where available; each class of op and the cs336 steps'
# own ops timed on the GPU (gpu_ops.py); the CUDA-only tests. Ends by its --budget (450 s by default) on one
# H100/H200; prints a short table last, full results in the results dir.
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
