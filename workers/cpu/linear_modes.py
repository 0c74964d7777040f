"""Linear layers made fast for CPU serving, once at load.

On a CPU a decode step is a chain of one-row matrix products, each reading a whole weight
matrix from memory, so tokens/s is set by how many bytes the weights take and how fast the
kernel streams them. The modes of `--quantization` (numbers: README, benchmarks/cpu_peers.py
and benchmarks/perplexity.py):

- "none" (exact): float32 weights on Antiphon's own float32 product where the CPU has
  AVX-512F (float32_linear.py), else repacked into oneDNN's blocked layout (both faster
  than `F.linear` for one row: benchmarks/float32_products.py).
  Same math as `F.linear`; only the order of the additions differs, at rounding level.
- "bf16": bfloat16 weights, oneDNN-packed; each linear rounds its input to bfloat16 and
  rounds the product to bfloat16 too; the bias is added in float32. Half the bytes; fast
  only where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX).
- "int4": 4-bit weights in groups of 32 (GGUF's Q4_1 layout) for decode steps of up to 8
  rows on torch's kernel (512 on the native one: row_layout.KernelRowLimits), a copy for
  larger steps and prompt rows: bfloat16 where oneDNN has a bfloat16 product, float32 on
  AVX2-only CPUs (int4.py, row_layout.py). An eighth of float32's bytes per generated
  token (benchmarks/int4_kernels.py). Lossy for a checkpoint that was not 4-bit.
- "int8": fbgemm's dynamic quantization: weights int8 per output channel, each step's
  activations quantized per tensor on the fly. Small models lose a lot (perplexity:
  benchmarks/perplexity.py), so never the default.
- "auto" (the default): every layer whose weights already lie on the 4-bit grid (a
  checkpoint converted from a Q4_1 GGUF file, as the default model is: the codes lose
  nothing) is "int4", where the CPU has native bfloat16 or the native 4-bit kernel runs
  without it (AVX2); the other layers are "bf16" where the CPU has native bfloat16, else
  "none". A CPU with AVX-512 but without native bfloat16 (Skylake-SP to Ice Lake-SP) has
  oneDNN's emulated bfloat16 product, slower than float32, and no rule here for it yet: auto
  is exact there.

Outside exact mode, on a CPU with native bfloat16, the output matrix (lm_head) is bfloat16
with each row's top candidates recomputed in float32 (output_layer.py); without it, float32,
whose greedy steps pick their winners from a 4-bit copy where the native 4-bit kernel runs
(AVX2; output_layer.py); in exact mode float32, as the other layers (or oneDNN-packed). Tied to the token embedding table,
it is held as a copy in its kernel's layout; the table keeps its float weights for lookups
(and for those exact candidates).
"""

from __future__ import annotations

import warnings

import torch

from engine.config import QUANTIZATION_MODES
from workers.cpu.features import cpu_flags
from workers.cpu.float32_linear import Float32Linear, can_tile
from workers.cpu import int4
from workers.cpu.int4 import Int4Linear, can_quantize, int4_if_on_grid, kernel_available, quantize_int4
from workers.cpu.output_layer import RescoredOutputLayer
from workers.cpu.packed_linear import PackedLinear, can_pack, can_pack_bf16

# Quality bound for the automatic choice: perplexity of the default model within this factor
# of exact mode's (benchmarks/perplexity.py). bf16 measures 0.999x, int4 and auto 0.998x;
# int8 2.51x.
AUTO_PERPLEXITY_BOUND = 1.02


def int8_linear(linear: torch.nn.Linear) -> torch.nn.Module:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    linear.qconfig = per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        # torch points users of this API at torchao; its CPU kernels are the ones measured
        # fastest here (torchao's int8 paths run on torch's int8 matmuls, slower on this CPU).
        warnings.simplefilter("ignore")
        return DynamicQuantizedLinear.from_float(linear)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them oneDNN emulates bfloat16, slower than float32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_quantization(requested: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The mode a model is served in: "auto" becomes a concrete mode (a float32 model on CPU
    may go faster; anything else is served as loaded); a CPU mode the model or the machine
    cannot run is refused before any weight is read."""
    if requested == "auto":
        serves_float32_on_cpu = device.type == "cpu" and dtype == torch.float32
        return "bf16" if serves_float32_on_cpu and can_pack() and cpu_has_native_bf16() else "none"
    if requested != "none":
        if device.type != "cpu":
            raise ValueError(f"quantization={requested} is a CPU mode; on {device.type} use none")
        if dtype != torch.float32:
            raise ValueError(f"quantization={requested} converts float32 weights; the model loads as {dtype} "
                             "(use --dtype float32, or quantization none)")
        if requested in ("bf16", "int4") and not can_pack():
            raise ValueError(f"quantization={requested} needs oneDNN (torch.backends.mkldnn), not available here")
        if not can_pack_bf16() and not (requested == "int4" and int4_without_bfloat16()):
            needs = ("the native 4-bit kernel (AVX2, FMA and F16C, and the native library built: "
                     "workers/cpu/native_library.py)" if requested == "int4" else "AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
            raise ValueError(f"quantization={requested} computes in bfloat16 through oneDNN, which this CPU cannot "
                             f"without {needs}; use quantization none")
        if requested == "int4" and not kernel_available():
            raise ValueError("quantization=int4 needs torch's 4-bit CPU kernel (_weight_int4pack_mm_for_cpu), "
                             "missing from this torch build")
    return requested


def int4_without_bfloat16() -> bool:
    """Whether 4-bit layers run on this CPU though it has no bfloat16 product (AVX2 without
    AVX-512): the native 4-bit kernel computes their generated rows (int4_product_avx2.cpp)
    and a float32 copy their prompt rows (int4.Int4Linear). Waits for the native
    library's build on a first start, as loading 4-bit layers does anyway."""
    return can_pack() and not can_pack_bf16() and int4.native_kernel_available()


def auto_serves_int4(mode: str) -> bool:
    """Whether `auto`, resolved to `mode`, serves 4-bit the layers whose weights are 4-bit
    already (a checkpoint converted from a Q4_1 GGUF file, as the default model): beside
    bfloat16 layers, and beside exact float32 ones on CPUs without a bfloat16 product, where
    reading a quarter of float32's bytes per generated token is most of a decode step's time
    (benchmarks/int4_kernels.py)."""
    return mode == "bf16" or (mode == "none" and int4_without_bfloat16())


def prepare_linear_layers(model: torch.nn.Module, mode: str, int4_where_exact: bool = False) -> dict[str, int]:
    """Replace every float32 nn.Linear of `model` (on CPU) by its fast form; returns how many
    layers became what. Mode "none" without the native float32 product or oneDNN keeps the
    layers as they are.

    `int4_where_exact` (what `auto` asks for): a layer whose weights already lie on the 4-bit
    grid (a checkpoint converted from a Q4_1 GGUF file) becomes 4-bit with no loss in its
    codes where `auto_serves_int4(mode)`; the others take `mode`. The output matrix: see the
    module's docstring (`auto` keeps it exact unless the layers before it went 4-bit)."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    counts: dict[str, int] = {}
    if mode == "none" and not can_pack() and not native_float32_available():
        return counts
    convert = {"none": float32_linear, "bf16": lambda linear: PackedLinear(linear, torch.bfloat16),
               "int8": int8_linear, "int4": int4_linear}[mode]
    output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # Asked at the first layer on the 4-bit grid, not before: on an AVX2 CPU the answer waits
    # for the native library's build, which a float32 checkpoint has no use for.
    serves_int4: bool | None = None
    names = [name for name, module in model.named_modules()
             if name and type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
             and module.weight.device.type == "cpu"]
    # The output layer last: its form depends on whether the layers before it went 4-bit.
    names.sort(key=lambda name: model.get_submodule(name) is output_layer)
    # One at a time, so each original weight is freed as its replacement is made (peak memory
    # is the model plus one matrix, not twice the model).
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, child)
        if module is output_layer and (mode != "none" or serves_int4) and can_pack():
            # (Exact mode's output matrix is converted as its other layers, below; `auto`'s
            # too, unless the layers before it were served 4-bit: it is no longer exact then.)
            # Emulated bfloat16 would be slower than float32 (cpu_has_native_bf16). Without it,
            # where the native 4-bit kernel runs (AVX2), greedy steps still pick their
            # candidates from a 4-bit copy: it reads 14 MB of the default model's matrix, not
            # 113 (output_layer.py).
            if not cpu_has_native_bf16():
                replacement = _float32_output_layer(module)
            else:
                # Tied or not, its float32 weights serve the exact candidates (no copy).
                replacement = RescoredOutputLayer(module)
        elif (int4_where_exact and serves_int4 is not False and module is not output_layer
              and can_quantize(module) and (quantized := int4_if_on_grid(module.weight))
              and (serves_int4 := auto_serves_int4(mode) if serves_int4 is None else serves_int4)):
            replacement = Int4Linear(module, quantized)
        else:
            replacement = convert(module)
        kind = describe(replacement)
        setattr(parent, child, replacement)
        counts[kind] = counts.get(kind, 0) + 1
        del module
    return counts


def _float32_output_layer(linear: torch.nn.Linear) -> torch.nn.Module:
    """The output layer outside exact mode on a CPU without native bfloat16: float32, with
    greedy steps' winners picked from a 4-bit copy where the native 4-bit kernel takes the
    matrix (output_layer.py); plain float32 where it does not (no native kernel, a shape off
    its tiles, scales outside float16), since torch's 4-bit kernel would need bfloat16 input."""
    if int4_without_bfloat16():
        layer = RescoredOutputLayer(linear, approximate_dtype=torch.float32)
        if layer.selector is not None and layer.selector.product.native:
            return layer
    return PackedLinear(linear)


def native_float32_available() -> bool:
    """Whether exact mode's layers take the native float32 product (waits for the library's
    build on a first start: native_library.float32_product_available)."""
    from workers.cpu import native_library  # here: native_library imports this module

    return native_library.float32_product_available()


def float32_linear(linear: torch.nn.Linear) -> torch.nn.Module:
    """Exact mode's layer: the native float32 product where it runs, else oneDNN's (or, without
    oneDNN, the layer as it is)."""
    if can_tile(linear) and native_float32_available():
        return Float32Linear(linear)
    return PackedLinear(linear) if can_pack() else linear


def int4_linear(linear: torch.nn.Linear) -> torch.nn.Module:
    """Every layer 4-bit, lossy for a checkpoint that was not (a layer whose shape the kernel
    does not take stays bfloat16, or float32 where oneDNN has no bfloat16 product)."""
    if not can_quantize(linear):
        return PackedLinear(linear, torch.bfloat16 if can_pack_bf16() else torch.float32)
    if not torch.isfinite(linear.weight).all():
        raise ValueError(f"quantization=int4: a {tuple(linear.weight.shape)} linear layer has non-finite weights")
    return Int4Linear(linear, quantize_int4(linear.weight))


def describe(layer: torch.nn.Module) -> str:
    """What a converted layer is, for the load log: from its type, not from the mode asked."""
    if isinstance(layer, Int4Linear):
        return "int4"
    if isinstance(layer, RescoredOutputLayer):
        if layer.approximate_is_exact:
            return "output float32 (greedy candidates from a 4-bit copy)"
        return "output bf16 (top candidates float32)"
    if isinstance(layer, Float32Linear):
        return "float32 (native product)"
    if isinstance(layer, PackedLinear):
        return "float32" if layer.dtype == torch.float32 else "bf16"
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    return "int8" if isinstance(layer, DynamicQuantizedLinear) else type(layer).__name__
