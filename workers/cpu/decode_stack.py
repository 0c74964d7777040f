"""The decoder layers of a CPU decode step as one C++ call (csrc/decode_stack.cpp).

The lean forward (lean_forward.py) makes ~30 torch calls per layer from Python; on a CPU, for a
one-row step of a small model, the interpreter's share of each call is a large part of the
step. The C++ stack makes the same ATen calls in the same order (the rotary embedding as one
loop that rounds as they do), so the logits stay bitwise the model's own, without the
interpreter between them. It is built from the lean forward's layers (their tensors and
product descriptions), and takes the step's row layout as data (row_layout.StepRows).
"""

from __future__ import annotations

import torch

from workers.cpu import native_library
from workers.cpu.int4 import GROUP_SIZE


def stack_computes(layers) -> bool:
    """Whether the C++ stack computes these layers (lean_forward._Layer): see native_eligible,
    and one head size throughout."""
    return all(layer.native_eligible for layer in layers) and len({layer.head_dim for layer in layers}) == 1


def decode_stack(layers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
    """The C++ stack over `layers` (lean_forward._Layer) once the library is loaded, or None
    when it is not (yet) or a layer is of a kind it does not compute."""
    if not native_library.is_ready() or not stack_computes(layers):
        return None
    stack = torch.classes.antiphon_cpu.DecodeStack(layers[0].head_dim, GROUP_SIZE)
    for layer in layers:
        (input_norm, input_eps), (post_norm, post_eps), native_norm = layer.native_norms
        key_cache, value_cache = kv_caches[layer.index]
        stack.add_layer(input_norm, input_eps, post_norm, post_eps, native_norm, layer.scaling, key_cache,
                        value_cache)
        for group in layer.groups:
            stack.add_group(group.rounds_always, group.rounds_above)
            for kind, *tensors in group.native_parts:
                stack.add_product(int(kind), *tensors)
            if group.native_fused is not None:
                stack.fuse_group(*group.native_fused)
    stack.finish()
    return stack
