"""A CPU engine's memory stays bounded whatever row counts its steps take (issue 29: the soak's
decoder grew 154 MiB in 3 minutes, oneDNN keeping a primitive for every product shape and
row count it had seen; workers/cpu/onednn_primitives.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# In a process of its own: the caches take their capacity from the first primitive a process
# makes, and this test process has made many. Prompts of 24, 25, ... tokens: each prefill step
# is a new row count for every layer's products. RSS is read after the first 24 lengths (a
# bounded cache is full by then) and after 100 more.
SCRIPT = r"""
import random, sys
import psutil
from engine import LLM, SamplingParams

llm = LLM(sys.argv[1], quantization="none", enable_prefix_caching=False)
rng = random.Random(0)
params = SamplingParams(temperature=0, max_tokens=1)
process = psutil.Process()

def prompts(lengths):
    for length in lengths:
        llm.generate([[rng.randrange(3, 300) for _ in range(length)]], params)

prompts(range(24, 48))
before = process.memory_info().rss
prompts(range(48, 148))
print((process.memory_info().rss - before) / 2**20)
"""

# What 100 new row counts may add once the caches are full (the requests' Python objects,
# allocator slack: 7 MiB here); unbounded, the caches grew 229 MiB (four product shapes).
MAX_GROWTH_MIB = 24


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_steps_of_new_row_counts_do_not_grow_the_decoder(tiny_llama):
    # ANTIPHON_NATIVE_DECODE=0: exact mode's layers are oneDNN's on every CPU (the native float32
    # product would take these prompts' rows on AVX-512 ones).
    env = {**os.environ, "ANTIPHON_NATIVE_DECODE": "0", "PYTHONPATH": str(REPO)}
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    growth = float(result.stdout.strip().splitlines()[-1])
    assert growth < MAX_GROWTH_MIB, f"RSS grew {growth:.1f} MiB over 100 prompts of new lengths"
