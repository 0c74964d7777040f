"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens.

It keeps its own copy of each request's tokens and block ids, updated from the scheduler's
deltas, so it can run in another process. All scheduled tokens of all requests go through
the model as one packed sequence; logits are computed only for rows that sample, by the
model's own forward (logits_to_keep), so its final softcapping or logit scale applies.

The step's layout is planned on the host from the runner's request states (batch_planning.py)
and turned into the attention layers' view of it (step_attention.py). With the Triton attention
backend (CUDA) the single-token rows go first and the layers read block tables; a pure-decode
step of a text model replays a CUDA graph (decode_graphs.py).

For a multimodal model the runner holds the item embeddings the scheduler hands it, feeds
the model input embeddings in which each item's placeholder rows are that item's embeddings
(the slice the chunk covers, when a chunk ends inside an item), and computes the family's
positions (M-RoPE for Qwen2-VL) through its adapter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.grammars import GrammarCompiler
from engine.hidden_state_store import HiddenStateStore
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from workers.batch_planning import PackedBatch, RunnerRequest, plan_batch
from workers.cpu import native_attention, row_layout
from workers.cpu.output_layer import RescoredOutputLayer, full_precision_logits
from workers.decode_graphs import DecodeGraphs
from workers.host_staging import HostToDevice
from workers.cpu.lean_forward import lean_decoder_for
from workers.cpu.row_layout import StepRows
from workers.forward_context import set_forward_context
from workers.sampler import SamplingRow, sample
from workers.step_attention import attention_metadata
from workers.structured_decoding import StructuredDecoding

logger = logging.getLogger("antiphon")


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # what the cache holds (workers/kv_cache_dtype.py)


class ModelRunner:
    """`attention_backend`: "torch" or "triton" (resolved, workers/paged_attention.py).
    `decode_graphs`: "off", "capture" or "padded-eager"; graphs need the Triton backend,
    a text model and `max_model_len` (the block-table width they are captured with)."""

    def __init__(self, model: torch.nn.Module, cache_shape: KVCacheShape, adapter=None,
                 grammar_compiler: GrammarCompiler | None = None, attention_backend: str = "torch",
                 decode_graphs: str = "off", max_graph_batch_size: int = 256,
                 max_model_len: int | None = None, hidden_store: HiddenStateStore | None = None) -> None:
        self.model = model
        # An omni thinker's per-position rows for its talker, written every step through the
        # step's slot mapping, where the keys and values go (engine/hidden_state_store.py).
        self.hidden_store = hidden_store
        # A rescored output layer (fast CPU modes: workers/cpu/output_layer.py) to be told which
        # rows need float32 logits and which steps are plain greedy.
        output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.rescored_output = output_layer if isinstance(output_layer, RescoredOutputLayer) else None
        self.use_kernels = attention_backend == "triton"
        # Structured output (None: no grammar engine here; such requests are refused earlier).
        self.structured = StructuredDecoding(grammar_compiler) if grammar_compiler is not None else None
        # The family's adapter for a multimodal model (engine/adapters/), else None.
        self.adapter = adapter
        # A Llama-like text model on CPU runs its forward as plain torch calls (bitwise the
        # same logits, far fewer calls: workers/cpu/lean_forward.py).
        self.lean = lean_decoder_for(model) if adapter is None and not self.use_kernels else None
        # The 4-bit kernels' row limits its steps' layouts carry (workers/cpu/row_layout.py).
        self.row_limits = row_layout.KERNEL_ROW_LIMITS
        self.uses_mrope = adapter is not None and adapter.uses_mrope
        self.embed_tokens = model.get_input_embeddings() if adapter is not None else None
        # mm_hash -> [n, hidden] embeddings on the device, as long as the scheduler says.
        self.item_embeddings: dict[str, torch.Tensor] = {}
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size = cache_shape.block_size
        num_slots = cache_shape.num_blocks * cache_shape.block_size
        # Zeros, not empty: padded gathers read block 0, which must hold finite values.
        self.kv_caches = [
            (torch.zeros(num_slots, cache_shape.num_kv_heads, cache_shape.head_dim, dtype=cache_shape.dtype,
                         device=self.device),
             torch.zeros(num_slots, cache_shape.num_kv_heads, cache_shape.head_dim, dtype=cache_shape.dtype,
                         device=self.device))
            for _ in range(cache_shape.num_layers)
        ]
        if self.lean is not None:
            self.lean.attach_native(self.kv_caches)
        # Decode rows attend with the native kernel (read in place, any lengths in one group)
        # where the model's layers run a native product: workers/cpu/native_attention.py.
        self.native_attention = (not self.use_kernels and self.device.type == "cpu"
                                 and native_attention.serves(model, cache_shape.head_dim))
        self.requests: dict[str, RunnerRequest] = {}
        self.to_device = HostToDevice(self.device)
        self.graphs: DecodeGraphs | None = None
        if decode_graphs != "off":
            if not self.use_kernels or adapter is not None or max_model_len is None:
                raise ValueError("decode graphs need the triton attention backend, a text-only model and "
                                 "max_model_len")
            self.graphs = DecodeGraphs(
                self._decode_forward, self.kv_caches, self.block_size, max_model_len,
                max_graph_batch_size, self.device, capture=decode_graphs == "capture", to_device=self.to_device)

    def capture_graphs(self) -> None:
        """Record the decode graphs (after the KV caches exist, before the first step). A
        model whose forward cannot be captured (one that reads a tensor's value on the host;
        dynamic RoPE scaling is turned away before this) is served eagerly, with a warning."""
        if self.graphs is None or not self.graphs.record:
            return
        torch.cuda.set_device(self.device)
        try:
            with torch.inference_mode():
                self.graphs.capture()
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves eager decoding, which works
            logger.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(exc).__name__, exc)
            self.graphs = None
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits[0]

    # ---- state -------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
            if self.structured is not None:
                self.structured.remove(request_id)
        for new in sched.new_requests:
            if new.sampling_params.structured_output is not None:
                self._structured().add(new.request_id, new.sampling_params, new.eos_token_ids, new.grammar)
            state = self.requests[new.request_id] = RunnerRequest(
                token_ids=list(new.token_ids), num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens, mm_placeholders=list(new.mm_placeholders))
            if self.uses_mrope and state.mm_placeholders:
                state.mrope_positions, state.mrope_delta = self.adapter.prompt_positions(
                    new.num_prompt_tokens, state.mm_placeholders)
            if self.hidden_store is not None:
                # The blocks the prefix cache gave it (whole blocks: num_computed_tokens counts
                # them, and a resumed request starts from 0) keep their rows; the rest are fresh.
                hits = -(-new.num_computed_tokens // self.block_size)
                self.hidden_store.allocated(state.block_ids[hits:])
        for mm_hash, embeddings in sched.new_embeddings.items():
            self.item_embeddings[mm_hash] = embeddings.to(self.device, self.dtype)
        cached = sched.cached_requests
        for request_id, new_block_ids, num_computed in zip(cached.request_ids, cached.new_block_ids,
                                                           cached.num_computed_tokens):
            state = self.requests[request_id]
            if new_block_ids:
                state.block_ids.extend(new_block_ids)
                if self.hidden_store is not None:
                    self.hidden_store.allocated(new_block_ids)
            state.num_computed_tokens = num_computed

    def _structured(self) -> StructuredDecoding:
        if self.structured is None:
            raise RuntimeError("structured output needs a grammar compiler in the model runner")
        return self.structured

    # ---- one step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.device.type == "cuda":
            # Per thread, and steps may run on the core's worker thread: Triton launches and
            # events use the current device, whatever device the tensors are on.
            torch.cuda.set_device(self.device)
        self._update_states(sched)
        try:
            return self._execute(sched)
        finally:
            # After the step: it may have used them (also when it failed).
            for mm_hash in sched.free_embeddings:
                self.item_embeddings.pop(mm_hash, None)

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if sched.is_empty:
            return ModelRunnerOutput()
        request_ids = list(sched.num_scheduled_tokens)
        # Single-token rows first (the decode kernels take them, the prefill kernel the rest),
        # generated tokens' first among them (the fast CPU products compute those as in a step
        # of generated tokens alone: workers/cpu/row_layout.py).
        request_ids.sort(key=lambda r: (sched.num_scheduled_tokens[r] != 1, self.requests[r].computes_prompt))
        states = [self.requests[r] for r in request_ids]
        batch = plan_batch(states, [sched.num_scheduled_tokens[r] for r in request_ids], block_size=self.block_size,
                           use_kernels=self.use_kernels, uses_mrope=self.uses_mrope)
        rows = [states[i] for i in batch.sample_rows]
        # The grammar masks of this step are filled on another thread while the model runs.
        masks = None
        if self.structured is not None and self.structured.requests:
            constrained = [(index, request_ids[row], state.token_ids, state.num_prompt_tokens)
                           for index, (row, state) in enumerate(zip(batch.sample_rows, rows))
                           if request_ids[row] in self.structured.requests]
            if constrained:
                masks = self.structured.start_step(len(rows), constrained)
        # Rows whose logits the sampler changes (or returns as log-probabilities) need every
        # logit exact where the output layer is rescored (workers/cpu/output_layer.py).
        exact_rows, greedy_step = [], False
        if self.rescored_output is not None:
            exact_rows = [index for index, (row, state) in enumerate(zip(batch.sample_rows, rows))
                          if _reads_the_whole_row(state.sampling_params) or (
                              self.structured is not None and request_ids[row] in self.structured.requests)]
            # Only the winner of each row is read: its candidates may come from a cheaper copy.
            greedy_step = bool(rows) and not exact_rows and all(s.sampling_params.greedy for s in rows)
        with full_precision_logits(self.rescored_output, exact_rows, greedy_step):
            logits = self._forward(batch, states)
            # A greedy step's winners, picked by the output layer itself (no argmax over the rows).
            winners = self.rescored_output.greedy_winners if greedy_step else None
        output = ModelRunnerOutput()
        if not batch.sample_rows:
            return output
        step_masks = masks.result() if masks is not None else None
        if winners is not None and len(winners) == len(rows):
            token_ids, logprobs = winners.tolist(), [None] * len(rows)
        else:
            token_ids, logprobs = sample(logits, [
                SamplingRow(s.sampling_params, s.token_ids[:s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens:])
                for s in rows], constrain=(lambda x: self.structured.apply(x, step_masks)) if step_masks else None)
        for index, (row, state, token_id, lp) in enumerate(zip(batch.sample_rows, rows, token_ids, logprobs)):
            request_id = request_ids[row]
            # Appended even when the request fails: with asynchronous scheduling its next step
            # is already scheduled and must find as many tokens as it was given.
            state.token_ids.append(token_id)
            if step_masks is not None and index in step_masks.errors:
                output.errors[request_id] = step_masks.errors[index]
                continue
            output.sampled_token_ids[request_id] = token_id
            if lp is not None:
                output.logprobs[request_id] = lp
        return output

    def _forward(self, batch: PackedBatch, states: list[RunnerRequest]) -> torch.Tensor:
        """Logits of the rows that sample, in batch.sample_rows order."""
        is_pure_decode = batch.num_decodes == len(batch.ends)
        if self.graphs is not None and is_pure_decode and len(batch.ends) <= self.graphs.max_batch_size:
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                                     batch.ends)
            if len(batch.sample_rows) == len(batch.ends):
                return logits
            # In a pure-decode step a row's logits index is the row itself.
            return logits[self.to_device("logits_index", batch.logits_index)]
        positions = self._positions(batch)
        attention = attention_metadata(batch, self.kv_caches, self.block_size, self.to_device,
                                       use_kernels=self.use_kernels, native_attention=self.native_attention)
        input_ids = self.to_device("input_ids", batch.input_ids)
        logits_index = self.to_device("logits_index", batch.logits_index)
        with set_forward_context(attention, StepRows(len(batch.input_ids), batch.leading_generated, self.row_limits)):
            if self.lean is not None:
                return self.lean.forward(input_ids, positions, logits_index, attention)
            input_ids = input_ids.unsqueeze(0)
            if self.adapter is None:
                return self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                  logits_to_keep=logits_index).logits[0]
            embeds, item_rows = self._input_embeddings(input_ids, states, batch)
            logits = self.model(inputs_embeds=embeds, position_ids=positions, use_cache=False,
                                logits_to_keep=logits_index).logits[0]
            if self.hidden_store is not None:
                rows = self.adapter.talker_rows(self.model.talker_hidden_states[0], embeds[0], item_rows)
                self.hidden_store.write(torch.from_numpy(batch.slot_mapping), rows.cpu())
            return logits

    def _positions(self, batch: PackedBatch) -> torch.Tensor:
        """The step's positions on the device, shaped as the model takes them."""
        if self.uses_mrope:
            return self.to_device("positions", batch.positions).unsqueeze(1)  # [3, 1, T]
        return self.to_device("positions", batch.positions).unsqueeze(0)

    def _input_embeddings(self, input_ids: torch.Tensor, states: list[RunnerRequest],
                          batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings, with each item's rows in this step replaced by its embeddings, and
        which rows are items' ([T] bool)."""
        embeds = self.embed_tokens(input_ids)
        item_rows = torch.zeros(embeds.shape[1], dtype=torch.bool, device=embeds.device)
        for state, start, end, q0 in zip(states, batch.starts.tolist(), batch.ends.tolist(),
                                         batch.query_offsets.tolist()):
            for item in state.mm_placeholders:
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo >= hi:
                    continue
                source = self.item_embeddings.get(item.mm_hash)
                if source is None:
                    # The scheduler never schedules an item's tokens before its embeddings.
                    raise RuntimeError(f"embeddings of item {item.mm_hash[:16]} are not in the runner")
                embeds[0, q0 + lo - start:q0 + hi - start] = source[lo - item.offset:hi - item.offset]
                item_rows[q0 + lo - start:q0 + hi - start] = True
        return embeds, item_rows

    def talker_rows(self, request_id: str, start: int, end: int) -> torch.Tensor | None:
        """An omni request's talker rows for positions start..end-1, from the hidden-state store
        (computed by its own steps or found by its prefix hit); None while a block among them
        is not written through yet (seed 002: a hit published before its forward ran)."""
        state = self.requests[request_id]
        return self.hidden_store.read_positions(state.block_ids, start, end)


def _reads_the_whole_row(params: SamplingParams) -> bool:
    """A bias, a penalty or returned log-probabilities can make any token's logit matter."""
    return bool(params.logit_bias) or params.uses_penalties or params.logprobs is not None
