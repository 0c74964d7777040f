"""The output matrix (lm_head) in bfloat16, with the likeliest tokens' logits made exact.

The output matrix is the largest one of a small model (SmolLM2-135M: 113 MB of its 538 in
float32), so the fast CPU modes read it in bfloat16. But bfloat16 logits are coarse (steps of
0.125 around 20), and greedy choices between close logits are where rounding shows first: a
plain bfloat16 output matrix turned the default model's answer to "What is the capital of
France?" into French gibberish. So the `EXACT_CANDIDATES` highest bfloat16 logits of each
row are recomputed in float32 from the float weights (a gather of 32 rows, a few
microseconds): greedy picks and the tokens that top-k / top-p sampling can reach get
float32 logits, the tail keeps bfloat16 ones, which moves only its tiny probabilities.
"""

from __future__ import annotations

import torch

from workers.cpu_packed_linear import PackedLinear

# Covers greedy choices with margin, and --max-logprobs' default of 20 alternatives.
EXACT_CANDIDATES = 32


class RescoredOutputLayer(torch.nn.Module):
    """`nn.Linear` for logits: bfloat16 product, float32 for each row's top candidates.
    `exact_weight` is the float32 matrix (for a tied model, the embedding table: no copy)."""

    def __init__(self, linear: torch.nn.Linear, exact_weight: torch.Tensor,
                 candidates: int = EXACT_CANDIDATES) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.approximate = PackedLinear(linear, torch.bfloat16)
        self.register_buffer("exact_weight", exact_weight.detach(), persistent=False)
        self.candidates = min(candidates, self.out_features)
        self.weight = self.approximate.weight  # see PackedLinear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features).float()
        logits = self.approximate(rows)
        candidates = logits.topk(self.candidates, dim=-1).indices  # [R, C]
        exact = torch.bmm(self.exact_weight[candidates], rows.unsqueeze(-1)).squeeze(-1)
        if self.approximate.bias is not None:
            exact = exact + self.approximate.bias[candidates]
        logits.scatter_(-1, candidates, exact)
        return logits.view(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 with the top "
                f"{self.candidates} logits of each row in float32")
