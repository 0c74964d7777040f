"""The CPU backend: how a model's layers run fast on a CPU, bitwise as their own modules in
exact mode.

- linear_modes.py: `--quantization` (none, bf16, int4, int8, auto): which kind of product each
  linear layer becomes, at load; its kinds are packed_linear.py (oneDNN), float32_linear.py (the
  native float32 product), int4.py (4-bit weights, torch's or the native kernel, with a copy)
  and output_layer.py (a bfloat16 output layer whose top candidates are rescored in float32).
- row_layout.py: the row rule, which rows of a step take a fast kernel and which the copy;
  decided once per step and carried by workers/forward_context.py.
- product_kinds.py: the kinds of product, read from csrc/product_kinds.def (C++ uses the same).
- lean_forward.py: the forward of a Llama-like model as plain torch calls (prompt and mixed
  steps); decode_stack.py: decode steps as one C++ call (csrc/decode_stack.cpp).
- native_attention.py, rms_norm.py: the native attention over the paged cache and RMSNorm.
- native_library.py: building and loading csrc/ (on first use, into $ANTIPHON_CACHE/native);
  features.py: what the CPU can do; onednn_primitives.py: a bound on oneDNN's caches.
"""
