#!/usr/bin/env bash
# Fetch, into .whl/ (git-ignored), the wheels a bare GPU image lacks for benchmarks/gpu_check.sh:
# jsonargparse with its [signatures] extras (LightningCLI needs them), torchao for the fp8 row, pytest
# for the CUDA-only tests, and HF tokenizers for the BPE corpus the cs336 configs read (imported without
# its huggingface-hub dependency, which only from_pretrained needs).
# gpu_check.sh installs whatever is in .whl/ into a temp dir before it runs. Python 3.12, x86-64 Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 torchao==0.17.0 \
  pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 tokenizers==0.23.3
ls -la .whl
