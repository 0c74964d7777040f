"""Vectorized sampling over the rows of one step.

Greedy rows take the argmax. Random rows are temperature-scaled, filtered (top-k, top-p,
min-p) and drawn with the exponential race argmax(p / E), E ~ Exp(1), which equals a
multinomial draw. Seeded rows draw E from a generator seeded by (seed, output index), so a
seeded request gives the same tokens whatever it is batched with, and after preemption.

Every tensor is made on the logits' device: on a GPU the only host sync of a step is reading
the sampled tokens (and the log-probabilities, when asked for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.scheduler_output import TokenLogprobs


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           constrain: Callable[[torch.Tensor], None] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [R, V], one row per request to sample. `constrain` masks the float32 logits in
    place (structured output); log-probabilities are the model's own, taken before it."""
    logits = logits.float()
    raw_logprobs = None
    if any(r.params.logprobs is not None for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    biased = any(r.params.logit_bias for r in rows)
    penalized = any(r.params.uses_penalties for r in rows)
    if constrain is not None or biased or penalized:
        logits = logits.clone()  # the raw logprobs above may share its memory
        for index, row in enumerate(rows):
            if row.params.logit_bias:
                _apply_logit_bias(logits[index], row.params.logit_bias)
            if row.params.uses_penalties:
                _apply_penalties(logits[index], row)
        if constrain is not None:
            # Last, over finite values: a bias or penalty that sends every allowed token to
            # -inf must not let a forbidden one win the tie.
            logits.clamp_(min=torch.finfo(logits.dtype).min)
            constrain(logits)

    greedy = all(r.params.greedy for r in rows)
    if greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _sample_mixed(logits, rows)

    token_list = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is not None:
        _collect_logprobs(raw_logprobs, tokens, rows, logprobs)
    return token_list, logprobs


def _collect_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                      out: list[TokenLogprobs | None]) -> None:
    """The sampled token's log-probability and the top n of each row that asked, in one topk
    and one read back from the device for all of them."""
    asking = [index for index, row in enumerate(rows) if row.params.logprobs is not None]
    index = torch.tensor(asking, device=raw_logprobs.device)
    asked = raw_logprobs[index]
    chosen = asked.gather(1, tokens[index].unsqueeze(1)).squeeze(1).tolist()
    most = min(max(rows[i].params.logprobs for i in asking), raw_logprobs.shape[-1])
    top_values, top_ids = ([], [])
    if most > 0:
        values, ids = asked.topk(most)
        top_values, top_ids = values.tolist(), ids.tolist()
    for position, row_index in enumerate(asking):
        n = rows[row_index].params.logprobs
        top = list(zip(top_ids[position][:n], top_values[position][:n])) if n > 0 else []
        out[row_index] = TokenLogprobs(chosen[position], top)


def _apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    vocab = logits.shape[0]
    ids = [token_id for token_id in bias if token_id < vocab]
    if ids:
        logits[torch.tensor(ids, device=logits.device)] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype,
                                                                        device=logits.device)


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    params = row.params
    vocab = logits.shape[0]
    if params.repetition_penalty != 1.0:
        # Filtered on the host: a boolean mask on the device would read its count back.
        seen = torch.tensor(sorted(t for t in set(row.prompt_token_ids) | set(row.output_token_ids) if t < vocab),
                            dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if row.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        # scatter_add_, not bincount, which reads the largest id back to size its output.
        output_ids = torch.tensor([t for t in row.output_token_ids if t < vocab], dtype=torch.long,
                                  device=logits.device)
        counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device).scatter_add_(
            0, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def _sample_mixed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    greedy_tokens = logits.argmax(dim=-1)
    temperature = torch.tensor([r.params.temperature if not r.params.greedy else 1.0 for r in rows],
                               dtype=logits.dtype, device=device)
    scaled = logits / temperature.unsqueeze(1)

    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype, device=device)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)

    # One draw for the whole batch from the global generator, then the seeded rows redrawn
    # from their own: one launch instead of one per row.
    noise = torch.empty_like(probs).exponential_()
    for index, row in enumerate(rows):
        if row.params.seed is not None:
            seed = _step_seed(row.params.seed, len(row.output_token_ids))
            generator = torch.Generator(device=device).manual_seed(seed)
            noise[index].exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([r.params.greedy for r in rows], device=device)
    return torch.where(is_greedy, greedy_tokens, sampled)


def filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab, device = logits.shape[1], logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=device).unsqueeze(1)
    remove = ranks >= k
    p = torch.tensor(top_p, dtype=logits.dtype, device=device).unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Drop a token when the tokens ranked above it already reach p; the top one always stays.
    remove |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _step_seed(seed: int, step: int) -> int:
    # A cheap reversible mix keeps (seed, step) pairs apart; Generator seeds are 64-bit.
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) & 0x7FFFFFFFFFFFFFFF
