"""The forward pass of a Llama-like text model on CPU as plain torch calls: bitwise the same
logits as the model's own forward, with fewer calls.

Why it is kept beside the C++ decode stack (decode_stack.py), which computes the same layers:
the stack takes pure decode steps only; this forward takes every other step of these models
(prompt chunks, prompt chunks beside decoding streams, prefix-cache tails) and every step
until the native library is built or where it cannot be (no compiler, ANTIPHON_NATIVE_DECODE=0).
It also describes each layer to the stack (its tensors, its products' kinds), so the stack is
built from it. Against transformers' modules it saves their per-call machinery (30 layers x 9
module calls, keyword plumbing, output records, the mask helper), which on a CPU is a large
share of a small step: `python benchmarks/lean_forward.py` times both on the default model.
Transformers stays the model's definition and the reference: a model class this forward does
not mirror runs as its modules, and tests/test_lean_decoder.py compares the logits bitwise with
the model's forward in every CPU mode, on prefill chunks, decode batches and prefix-cache hits.

What it leaves out computes nothing:

- no nn.Module calls: the layers' tensors and kernels are looked up once, at load;
- products sharing an input (q/k/v, gate/up) share one bfloat16 copy of it in the bfloat16
  and 4-bit modes, instead of making one each (the copy is the same every time);
- the 4-bit and oneDNN products call their kernels directly (int4.py, packed_linear.py, with
  the same row rule: row_layout.py, the bias added in float32 after the product), and so does
  the native float32 product (float32_linear.py).

A layer it does not know (an int8 layer, a norm that was not fused) runs as its module, so
every mode is covered. Only model classes whose forward this one mirrors take it
(`LEAN_MODELS`).
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

import torch
import torch.nn.functional as F

from workers.forward_context import get_forward_context
from workers.cpu import decode_stack, int4, native_library, row_layout
from workers.cpu.float32_linear import Float32Linear
from workers.cpu.int4 import NATIVE_INT4, Int4Linear, Int4Product
from workers.cpu.packed_linear import PackedLinear
from workers.cpu.product_kinds import ProductKind
from workers.cpu.rms_norm import FusedRMSNorm
from workers.paged_attention import PagedAttentionMetadata, attend

logger = logging.getLogger("antiphon")

# Model classes whose forward (decoder layers, rotary embedding, final norm, output layer)
# is what `LeanDecoder.forward` computes, and their parts' classes.
LEAN_MODELS = {
    "LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"),
    "Qwen2ForCausalLM": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP"),
}

# The row counts the load-time probe checks a fused group of torch's 4-bit kernel at: the
# engine's limit for that kernel (row_layout.KERNEL_ROW_LIMITS). A step given a higher limit
# (a test's or a benchmark's layout) calls that group's layers one by one past it, and the C++
# stack is given no such group (_ProductGroup.native_fused).
FUSED_PROBE_ROWS = row_layout.KERNEL_ROW_LIMITS.torch_int4

# x float32 and its bfloat16 copy (None where no product of the group takes one) -> float32.
Product = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def lean_decoder_for(model: torch.nn.Module) -> "LeanDecoder | None":
    """The lean forward of a float32 CPU model whose structure it mirrors, else None."""
    parts = LEAN_MODELS.get(type(model).__name__)
    if parts is None or next(model.parameters()).device.type != "cpu":
        return None
    layer_class, attention_class, mlp_class = parts
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(
            type(layer).__name__ == layer_class and type(layer.self_attn).__name__ == attention_class
            and type(layer.mlp).__name__ == mlp_class for layer in layers):
        return None
    return LeanDecoder(model)


class LeanDecoder:
    def __init__(self, model: torch.nn.Module) -> None:
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.final_norm = _norm(inner.norm)
        self.lm_head = model.lm_head
        self.layers = [_Layer(layer) for layer in inner.layers[:model.config.num_hidden_layers]]
        # The C++ stack for decode steps (decode_stack.py), once built; see attach_native.
        self.native = None
        self._kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def attach_native(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Serve decode steps through the C++ stack as soon as it is built (in the
        background), if every layer is of a kind it computes."""
        if native_library.enabled() and decode_stack.stack_computes(self.layers):
            self._kv_caches = kv_caches
            native_library.start_build()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                attention) -> torch.Tensor:
        """input_ids [T] and positions [1, T] of the packed step, the rows to compute logits
        for, the step's attention metadata -> logits [len(logits_index), vocab]."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(x, positions)  # [1, T, head_dim] each
        # [1, 1, T, head_dim]: broadcast over heads, as the model's rotary helper does.
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self._kv_caches is not None and native_library.is_ready():
            self._use_native()
        # (A prompt's last token alone is a one-row step too: it takes the Python forward, whose
        # 4-bit layers take their bfloat16 copy in a prompt step; the stack's take 4 bits.)
        rows = get_forward_context().rows
        if self.native is not None and _one_decode_group(attention) and not rows.computes_prompt:
            group = attention.decode_groups[0]
            start = -1 if group.context_start is None else group.context_start
            x = self.native.forward(x, cos, sin, attention.slot_mapping, group.context_slots, group.context_mask,
                                    start, group.block_tables, group.context_lens, group.block_size,
                                    rows.kernel_rows_by_kind(x.shape[0]))
        else:
            for layer in self.layers:
                x = layer.forward(x, cos, sin, attention)
        # The final norm after picking the rows (the model norms all rows, then picks): the
        # same values, as RMSNorm works row by row, for fewer rows.
        return self.lm_head(self.final_norm(x[logits_index]))

    def _use_native(self) -> None:
        """Builds the C++ stack over the layers: tried once; if it fails, steps stay Python."""
        try:
            self.native = decode_stack.decode_stack(self.layers, self._kv_caches)
        except Exception as exc:  # noqa: BLE001 - the Python forward computes the same
            logger.warning("native CPU decode stack not used (%s: %s)", type(exc).__name__, exc)
        finally:
            self._kv_caches = None


def _one_decode_group(attention) -> bool:
    """A pure decode step whose rows, in batch order, attend as one group: the C++ stack's case."""
    return isinstance(attention, PagedAttentionMetadata) and attention.all_decodes_in_order


class _Layer:
    """One decoder layer's tensors and kernels, and its forward."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.index = attention.layer_idx
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        # Qwen2 layers of the "sliding_attention" type carry their window; attend() checks it.
        self.sliding_window = getattr(attention, "sliding_window", None)
        self.input_norm = _norm(layer.input_layernorm)
        self.post_attention_norm = _norm(layer.post_attention_layernorm)
        self.qkv = _ProductGroup([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj = _ProductGroup([attention.o_proj])
        self.gate_up = _ProductGroup([mlp.gate_proj, mlp.up_proj])
        self.down_proj = _ProductGroup([mlp.down_proj])
        act = mlp.act_fn
        self.act = F.silu if type(act).__name__ in ("SiLUActivation", "SiLU") else act
        # What the C++ stack needs (decode_stack.py): both norms fused, every product of a
        # kind it computes, SiLU, no window.
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        self.native_norms = ((*((n.weight, n.variance_epsilon) for n in norms), norms[0].native)
                             if all(isinstance(n, FusedRMSNorm) for n in norms) and norms[0].native == norms[1].native
                             else None)
        self.groups = (self.qkv, self.o_proj, self.gate_up, self.down_proj)
        self.native_eligible = (self.native_norms is not None and self.act is F.silu and self.sliding_window is None
                                and all(group.native_parts is not None for group in self.groups))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(self.input_norm(x))
        # The model's layouts: [1, heads, T, head_dim] views, rotated there.
        q = q.view(1, tokens, -1, self.head_dim).transpose(1, 2)
        k = k.view(1, tokens, -1, self.head_dim).transpose(1, 2)
        v = v.view(1, tokens, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = attend(attention, self.index, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                     self.scaling, self.sliding_window)
        (attended,) = self.o_proj(out.reshape(tokens, -1))
        x = x + attended
        gate, up = self.gate_up(self.post_attention_norm(x))
        (down,) = self.down_proj(self.act(gate) * up)
        return x + down


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _norm(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(module, FusedRMSNorm):
        shape, weight, eps = module.normalized_shape, module.weight, module.variance_epsilon
        if module.native:
            # Rows of [T, hidden] (the lean forward's shape): no reshape.
            native_norm = torch.ops.antiphon_cpu.rms_norm.default
            return lambda x: native_norm(x, weight, eps)
        return lambda x: F.rms_norm(x, shape, weight, eps)
    return module


class _ProductGroup:
    """The linear layers that take one input (q/k/v, gate/up, or one alone), as a function of
    x [T, in] float32 -> each layer's output [T, out] float32. The products that take a
    bfloat16 input share one rounded copy of x. Where all are 4-bit, their codes are also
    laid side by side (each layer's codes become a view of that tensor; only the small scales
    are copied), so a step whose rows all take the kernel makes one kernel call for the
    group, whose columns are bitwise the separate calls' (the native kernel computes each tile of 16
    outputs on its own; torch's is checked on a probe at load: its columns are independent in
    tiles of 64 outputs, not in its narrower tail tiles)."""

    def __init__(self, linears: list[torch.nn.Module]) -> None:
        self.fused = _fuse_int4(linears) if len(linears) > 1 else None
        self.fused_kind = None if self.fused is None else int(int4.kind_of(self.fused[0].native))
        # The row counts at which the fused columns are known to equal the separate ones: all,
        # on the native kernel; on torch's, those the load-time probe checked.
        self.fused_max_rows = (0 if self.fused is None else
                               FUSED_PROBE_ROWS if not self.fused[0].native else sys.maxsize)
        self.native_parts = [_native_product(linear) for linear in linears]
        self.parts = [_product(linear, description) for linear, description in zip(linears, self.native_parts)]
        kinds = {description[0] for description in self.native_parts if description is not None}
        # Whether the bfloat16 copy of the input is needed at all row counts, or above
        # the native kernel's rows limit only (it takes float32; its batched copy bfloat16, or
        # float32 where the CPU has no bfloat16 product). The C++ stack is given these too
        # (decode_stack.py): the one place the rule is derived.
        self.rounds_always = bool(kinds & {ProductKind.TORCH_INT4, ProductKind.PACKED_BF16})
        self.rounds_above = any(description[0] == ProductKind.NATIVE_INT4
                                and description[3].dtype == torch.bfloat16
                                for description in self.native_parts if description is not None)
        if any(part is None for part in self.native_parts):
            self.native_parts = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        rows = x.shape[0]
        step = get_forward_context().rows
        rounds = self.rounds_always or (self.rounds_above and step.kernel_rows(rows, NATIVE_INT4) < rows)
        rounded = x.to(torch.bfloat16) if rounds else None
        # (A step whose rows split between the kernel and the copy calls the parts, each split.)
        if (self.fused is not None and rows <= self.fused_max_rows
                and step.kernel_rows(rows, self.fused_kind) == rows):
            product, bias, sizes = self.fused
            out = product(x, rounded)
            return (out if bias is None else out + bias).split(sizes, dim=1)
        return [product(x, rounded) for product in self.parts]

    @property
    def native_fused(self) -> tuple | None:
        """The fused product as decode_stack.cpp's fuse_group takes it: on the native kernel
        only, whose columns equal the separate products' at any row count (the stack fuses at
        any count; torch's kernel is checked only up to FUSED_PROBE_ROWS)."""
        if self.fused is None or not self.fused[0].native:
            return None
        product, bias, sizes = self.fused
        return product.codes, product.scales, bias, sizes


def _fuse_int4(linears: list[torch.nn.Module]) -> tuple | None:
    """(the 4-bit product of all, bias or None, output sizes) of 4-bit layers side by side;
    None unless all are 4-bit on one kernel with all or none biased. Re-points each layer's
    codes at its outputs of the new tensor."""
    if not all(isinstance(linear, Int4Linear) for linear in linears):
        return None
    if len({linear.int4.native for linear in linears}) != 1:
        return None
    biases = [linear.bias for linear in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    fused = Int4Product.concatenate([linear.int4 for linear in linears])
    sizes = [linear.out_features for linear in linears]
    if not fused.native and not _fused_columns_match(linears, fused):
        return None
    for linear, codes in zip(linears, fused.column_views(sizes)):
        linear.int4 = Int4Product(linear.int4.native, codes, linear.int4.scales)
    bias = None if biases[0] is None else torch.cat(biases)
    return fused, bias, sizes


def _fused_columns_match(linears: list[Int4Linear], fused: Int4Product) -> bool:
    """Whether torch's kernel gives bitwise the separate products' columns for the fused
    product, for every row count from 1 to FUSED_PROBE_ROWS on a probe input (a step of more
    rows calls the layers one by one). It does for outputs in multiples of 64 (the default
    model's); narrower ones go through the kernel's tail tiles, which round apart."""
    probe = torch.Generator().manual_seed(0)
    for rows in range(1, FUSED_PROBE_ROWS + 1):
        x = torch.randn(rows, linears[0].in_features, generator=probe)
        separate = torch.cat([linear.int4(x) for linear in linears], dim=1)
        if not torch.equal(separate, fused(x)):
            return False
    return True


def _product(linear: torch.nn.Module, description: tuple | None) -> Product:
    """x float32 (and its bfloat16 copy, where some product takes one) -> float32 output: the
    layer's own rows_product, which owns how its rows are computed (and which
    decode_stack.cpp's products() follows, from the layer's description); a layer of another
    kind runs as its module."""
    if description is None:
        return lambda x, rounded: linear(x)
    return linear.rows_product


def _native_product(linear: torch.nn.Module) -> tuple | None:
    """The C++ stack's description of a product: (kind, weight, scales, batched copy, bias),
    kinds as in csrc/product_kinds.def; None for a layer it does not compute."""
    if isinstance(linear, Int4Linear):
        kind = int4.kind_of(linear.int4.native)
        return kind, linear.int4.codes, linear.int4.scales, linear.batched.packed_weight, linear.bias
    if isinstance(linear, PackedLinear):
        kind = ProductKind.PACKED_BF16 if linear.dtype == torch.bfloat16 else ProductKind.PACKED_FLOAT32
        return kind, linear.packed_weight, None, None, linear.bias
    if isinstance(linear, Float32Linear):
        return ProductKind.NATIVE_FLOAT32, linear.tiled, None, None, linear.bias
    return None
