"""The output matrix (lm_head) in bfloat16, with the likeliest tokens' logits in float32; or,
on a CPU without a bfloat16 product, in float32 with greedy steps' winners picked as below.

The output matrix is the largest one of a small model (SmolLM2-135M: 113 MB of its 538 in
float32), so the fast CPU modes read it in bfloat16. But bfloat16 logits are coarse (steps of
0.125 around 20) and greedy choices between close logits are where rounding shows first: a
plain bfloat16 output matrix turned the default model's answer to "What is the capital of
France?" into French gibberish. So the `EXACT_CANDIDATES` highest bfloat16 logits of each row
are recomputed in float32 from the float weights (a gather of 32 rows: microseconds).

What stays approximate: the other logits carry bfloat16 rounding (of the hidden state, the
weights and the product), so sampling that reaches past the top 32 (a top-k above 32, top-p
over a flat distribution, a high temperature) draws from slightly moved probabilities, and in
a rare near-tie a bfloat16 value may still top the float32 ones. Rows whose logits the sampler
changes before choosing (logit_bias, penalties, a grammar) or whose log-probabilities are
returned get float32 logits for the whole row instead (`full_precision_rows`): after a bias or
a mask the winner can be anywhere in the vocabulary.

A step whose rows are all plain greedy (`greedy_step`: argmax, nothing else read) of up to
the 4-bit kernel's rows (int4.py's kernel_max_rows, 8 or 512: prompt steps too, since it
only picks) needs only each row's winner: there the
candidates come from a 4-bit copy of the matrix (a quarter of bfloat16's bytes: with torch's
kernel 1.6 vs 4.0 ms for the default model's one row with caches flushed), the other logits
are set to -inf, and the winner is the float32 maximum over the candidates (the runner takes it
from `greedy_winners` instead of an argmax over the row). It differs from
the whole row's float32 argmax only if the float32 winner is not among the 4-bit copy's 32 highest
logits: at none of the 865 positions of benchmarks/data/english.txt on the default model
(tests/test_cpu_int4.py). The copy is lossy (the default model's output matrix is 8-bit in
its GGUF file), which is why it only picks.

On a CPU without a bfloat16 product where the native 4-bit kernel runs (AVX2), the matrix
stays float32 (`approximate_is_exact`): steps that are not plain greedy take its logits as they
are, and plain greedy steps pick their winners as above, reading the 4-bit copy (14 MB of the
default model's matrix) instead of the float32 one (113 MB). A greedy row's token then comes
from the picker when every row of its step is plain greedy and from the float32 product when
another request in the step samples, asks for log-probabilities or is constrained: they differ
only where the picker misses the float32 winner, which it did at none of the 865 positions.

In a model whose layers run native products on an AVX-512F CPU (the loader decides), the
candidates are picked and rescored by csrc/rescore_top.cpp: one pass over each
row's logits and a dot product per candidate read in place (~2 ms less than torch's topk,
gather and batched product in a 16-row step). Both return the candidates in ascending index
order, so the first float32 maximum among them is the lowest index, as an argmax over the
whole row picks (they may differ in which of equal logits make the cut).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from workers.cpu import int4
from workers.cpu.int4 import Int4Product, can_quantize, quantize_int4
from workers.cpu.packed_linear import PackedLinear

# Covers greedy choices with a wide margin; more costs a larger gather per row.
EXACT_CANDIDATES = 32


class RescoredOutputLayer(torch.nn.Module):
    """`nn.Linear` for logits: bfloat16 product, float32 for each row's top candidates and for
    the rows listed in `full_precision_rows` (or, with `approximate_dtype` float32, a float32
    product whose greedy steps pick from the 4-bit copy). The float32 values come from
    `linear`'s own float32 weight, kept as it is (for a tied model, the embedding table itself:
    no copy; an untied matrix is then held twice, as it is and packed)."""

    def __init__(self, linear: torch.nn.Linear, candidates: int = EXACT_CANDIDATES, native_rescore: bool = False,
                 approximate_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # float32 on a CPU without a bfloat16 product: then only greedy steps take the 4-bit
        # picker, and other steps' logits are float32 already (nothing to rescore).
        self.approximate = PackedLinear(linear, approximate_dtype)
        self.approximate_is_exact = approximate_dtype == torch.float32
        self.register_buffer("exact_weight", linear.weight.detach(), persistent=False)
        self.candidates = min(candidates, self.out_features)
        # Row indices (of this forward's output rows) computed wholly in float32; set per step
        # by the runner through `full_precision_logits`.
        self.full_precision_rows: list[int] = []
        # Whether every row of this forward is plain greedy; set per step by the runner.
        self.greedy_step = False
        # Greedy steps' candidate picker (None where the 4-bit kernel does not take the shape).
        self.selector = _Int4Selector.of(linear)
        # Whether the candidates are picked and rescored by csrc/rescore_top.cpp: set once by
        # the loader (model_loader.choose_native_parts), so a row's candidates never switch.
        self.native_rescore = native_rescore
        # Each row's winner in a greedy step (set by forward, read by the runner within
        # full_precision_logits); None otherwise.
        self.greedy_winners: torch.Tensor | None = None
        self.weight = self.approximate.weight  # see PackedLinear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features).float()
        bias = self.approximate.bias
        if len(self.full_precision_rows) == rows.shape[0] and not self.approximate_is_exact:
            # Every row exact: skip the bfloat16 pass. (A float32 product serves them as it
            # serves every other step, so a row's logits do not depend on its batchmates.)
            return F.linear(rows, self.exact_weight, bias).view(*hidden.shape[:-1], self.out_features)
        greedy = (self.greedy_step and self.selector is not None
                  and rows.shape[0] <= self.selector.product.kernel_max_rows)
        if greedy:
            logits = self.selector(rows)
            if bias is not None:
                logits += bias
        else:
            logits = self.approximate(rows)
            if self.approximate_is_exact:
                return logits.view(*hidden.shape[:-1], self.out_features)
        candidates, exact = self._rescore(logits, rows, bias)  # [R, C] each
        if greedy:
            # Only the float32 candidates may win: a coarser 4-bit logit must not.
            logits.fill_(float("-inf"))
            self.greedy_winners = candidates.gather(1, exact.argmax(dim=1, keepdim=True)).squeeze(1)
        logits.scatter_(-1, candidates, exact)
        if self.full_precision_rows:
            index = torch.tensor(self.full_precision_rows, dtype=torch.long)
            logits[index] = F.linear(rows[index], self.exact_weight, bias)
        return logits.view(*hidden.shape[:-1], self.out_features)

    def _rescore(self, logits: torch.Tensor, rows: torch.Tensor,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `candidates` highest logits (indices ascending) and their float32 values."""
        if self.native_rescore:
            return torch.ops.antiphon_cpu.rescore_top(logits, rows, self.exact_weight, bias, self.candidates)
        candidates = logits.topk(self.candidates, dim=-1).indices.sort(dim=-1).values
        exact = torch.bmm(self.exact_weight[candidates], rows.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            exact = exact + bias[candidates]
        return candidates, exact

    def extra_repr(self) -> str:
        kind = ("float32" if self.approximate_is_exact
                else f"bfloat16 with the top {self.candidates} logits of each row in float32")
        return (f"in_features={self.in_features}, out_features={self.out_features}, {kind}"
                + (", greedy steps' candidates from a 4-bit copy" if self.selector is not None else ""))


class _Int4Selector:
    """The output matrix in 4 bits, for picking a greedy row's candidates only."""

    # Quantized this many rows at a time: the float temporaries stay small (a large
    # vocabulary's whole matrix would take several times its own size at once).
    CHUNK_ROWS = 4096

    def __init__(self, weight: torch.Tensor) -> None:
        # It only picks candidates, so it takes the native kernel only if that is loaded already
        # (a bf16-mode model does not wait for the build), and one kernel for the whole matrix.
        self.product = self._quantize(weight, int4.native_kernel_available(wait=False))
        self.out_features = weight.shape[0]

    def _quantize(self, weight: torch.Tensor, native: bool) -> Int4Product:
        """Chunk by chunk; `native` falls back to torch's kernel as a whole if a chunk's scales
        do not fit float16 (the result's `native` says which)."""
        products = []
        for start in range(0, weight.shape[0], self.CHUNK_ROWS):
            products.append(quantize_int4(weight[start:start + self.CHUNK_ROWS]).product(native))
            if products[-1].native != native:
                return self._quantize(weight, False)
        return Int4Product.concatenate(products)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.product(rows)

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> "_Int4Selector | None":
        """None where the 4-bit kernels do not take the matrix: a shape off their tiles, or
        non-finite weights."""
        if not can_quantize(linear) or not torch.isfinite(linear.weight).all():
            return None
        return cls(linear.weight)


@contextlib.contextmanager
def full_precision_logits(layer: RescoredOutputLayer | None, rows: list[int], greedy_step: bool = False):
    """Within the block, the listed output rows of `layer` get float32 logits, and
    `greedy_step` says every row only takes its argmax (then read from layer.greedy_winners
    after the forward; None: no-op)."""
    if layer is None or (not rows and not greedy_step):
        yield
        return
    layer.full_precision_rows = rows
    layer.greedy_step = greedy_step
    layer.greedy_winners = None
    try:
        yield
    finally:
        layer.full_precision_rows = []
        layer.greedy_step = False
        layer.greedy_winners = None
