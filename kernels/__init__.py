"""Triton kernels for the GPU path, each beside a plain torch reference of the same math.

- cache_write.py: the step's keys and values into their cache slots (reshape_and_cache).
- decode_attention.py: paged decode attention with split-K and GQA heads sharing K/V loads.
- prefill_attention.py: paged attention for packed prefill chunks over their cached prefix.

workers/paged_attention.py calls them when the engine's attention backend is "triton" (the
default on CUDA). On a CPU they run only in Triton's interpreter (TRITON_INTERPRET=1), which
is how the tests check them against their references and the engine's greedy parity.
"""
