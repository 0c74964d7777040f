"""A bound on the oneDNN primitives that a process running the model on CPU keeps.

Every product that goes through oneDNN (`mkldnn._linear_pointwise`: the packed layers of
packed_linear.py, the lean forward's and the C++ stack's products, the bfloat16 copies of
4-bit layers, the float32 product's long chunks) is a primitive made for its exact shape: the
weight's and the number of rows. oneDNN keeps each one for the next call of that shape, and
torch's glue to it (ideep) keeps another cache beside it, 1024 entries each by default. A
primitive holds its JIT-compiled kernels, about half a MiB for a linear layer's product
whatever its size. A server's steps take whatever row counts the load makes (every decode batch
size, every prompt length up to the token budget), so with those defaults the decoder grew by
half a MiB per product shape for each new row count, towards 0.5-0.9 GiB: the soak's RSS verdict
failed (issue 29). tests/test_onednn_primitives.py measures it: 2.3 MiB per new prompt length
of a tiny Llama unbounded.

The bound keeps what saves work. Each layer of a step calls the same products as the layer
before it, so the caches must hold one whole step's primitives, or every layer makes them
again: a step uses at most 8 weight shapes (a Llama or Qwen2 layer's q, k, v, o, gate, up and
down, and the output layer) at 2 row counts (the C++ stack's two parts of a split step; a prompt
step's tokens and its sampled rows), 16 primitives. The capacity holds four such steps, so a
decode batch that keeps its size from one step to the next, or comes back to a recent one,
finds its primitives; a new row count costs about half a millisecond a shape to make. The
numbers do not change: a primitive made again for the same shape is the same kernel.
"""

from __future__ import annotations

import os

PRIMITIVES_PER_STEP = 8 * 2
PRIMITIVE_CACHE_CAPACITY = 4 * PRIMITIVES_PER_STEP

# oneDNN's cache (its older DNNL_ spelling is read too) and ideep's.
_ONEDNN_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
_IDEEP_VARIABLE = "LRU_CACHE_CAPACITY"


def bound_primitive_caches() -> None:
    """Sets both caches' capacity for this process, unless its environment already sets one.
    Each is read once, when the process makes its first oneDNN primitive (packing a layer's
    weights at load makes one), so this runs before the model loads; in a process that has
    used oneDNN already it changes nothing."""
    if not any(name in os.environ for name in _ONEDNN_VARIABLES):
        os.environ[_ONEDNN_VARIABLES[0]] = str(PRIMITIVE_CACHE_CAPACITY)
    os.environ.setdefault(_IDEEP_VARIABLE, str(PRIMITIVE_CACHE_CAPACITY))
