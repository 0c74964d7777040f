"""The engine's greedy tokens equal transformers' generate with the Triton kernels selected.

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py),
a program at a time, so these use the tiny models, short prompts and few tokens. The same
layouts as tests/test_greedy_parity.py: mixed steps of decodes and prefill chunks over a
cached prefix (small token budgets, block size 4), prefix-cache hits, preemption,
asynchronous scheduling, and decode steps through the CUDA-graph buffers, padded up to the
next captured batch size ("padded-eager": the same static buffers, without a capture).
"""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.reference import hf_greedy, load_reference_model

PROMPT_LENGTHS = [3, 21, 9, 14, 30]
MAX_TOKENS = [6, 4, 7, 5, 6]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_checkpoints):
    path = tiny_checkpoints[request.param]
    vocab_size = load_reference_model(path).config.vocab_size
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    expected = [hf_greedy(path, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    return path, prompts, expected


def greedy_params():
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def runner_of(llm: LLM):
    return llm.engine.core.executor.runner


@pytest.mark.parametrize("engine_kwargs", [
    dict(block_size=16),
    dict(block_size=4, max_num_batched_tokens=8),
    dict(block_size=4, max_num_batched_tokens=8, async_scheduling=True),
], ids=["one-step-prefill", "chunked-block-4", "chunked-async"])
def test_kernels_match_transformers(case, engine_kwargs):
    path, prompts, expected = case
    llm = LLM(str(path), num_kv_blocks=128, attention_backend="triton", decode_graphs="off", **engine_kwargs)
    assert runner_of(llm).use_kernels
    assert [o.token_ids for o in llm.generate(prompts, greedy_params())] == expected


def test_kernels_match_transformers_under_preemption(case):
    path, prompts, expected = case
    # 15 usable blocks of 4 tokens for 5 requests needing up to 9 each: some are preempted
    # and recomputed.
    llm = LLM(str(path), num_kv_blocks=16, block_size=4, max_num_batched_tokens=16,
              attention_backend="triton", decode_graphs="off")
    outputs = llm.generate(prompts, greedy_params())
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected


def test_kernels_match_transformers_on_prefix_cache_hits(case):
    """The second pass reads its prompts' full blocks from the cache: the prefill kernel
    attends to a cached prefix written in an earlier step."""
    path, prompts, expected = case
    llm = LLM(str(path), num_kv_blocks=128, block_size=4, attention_backend="triton", decode_graphs="off")
    first = llm.generate(prompts, greedy_params())
    second = llm.generate(prompts, greedy_params())
    assert [o.num_cached_tokens for o in second] == [(n - 1) // 4 * 4 for n in PROMPT_LENGTHS]
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected


def test_decode_graph_buffers_with_padding_match_transformers(case):
    """5 requests decode at batch sizes 5..1; the ladder (1, 2, 4, 8) pads 5 to 8 and 3 to 4:
    padded rows must write no slot and change no real row's tokens."""
    path, prompts, expected = case
    llm = LLM(str(path), num_kv_blocks=128, block_size=4, max_model_len=64, max_graph_batch_size=8,
              attention_backend="triton", decode_graphs="padded-eager")
    graphs = runner_of(llm).graphs
    assert graphs.sizes == [1, 2, 4, 8]
    assert [o.token_ids for o in llm.generate(prompts, greedy_params())] == expected
    assert graphs.steps_run > 0


def test_padded_graph_rows_write_no_cache_slot(tiny_llama):
    """A batch of 3 runs at the captured size 4; the fourth row still holds the last step's
    slot, which may belong to a block that has since been freed and given to another request.
    Only the 3 real rows may write the cache."""
    import numpy as np

    llm = LLM(str(tiny_llama), num_kv_blocks=32, block_size=4, max_model_len=64, max_graph_batch_size=4,
              attention_backend="triton", decode_graphs="padded-eager")
    runner = runner_of(llm)
    graphs = runner.graphs
    tables = np.arange(1, 9, dtype=np.int32).reshape(4, 2)

    def step(rows: int, slots: list[int]) -> None:
        with torch.inference_mode():
            graphs.run(np.full(rows, 5), np.full(rows, 2), np.asarray(slots), tables[:rows], np.full(rows, 3))

    step(4, [6, 10, 14, 18])
    for keys, values in runner.kv_caches:  # slot 18's block now holds another request's tokens
        keys[18] = 0.5
        values[18] = 0.5
    before = [k.clone() for k, _ in runner.kv_caches]
    step(3, [7, 11, 15])
    for layer, (keys, _) in enumerate(runner.kv_caches):
        changed = sorted(set((keys != before[layer]).any(dim=-1).any(dim=-1).nonzero().flatten().tolist()))
        assert changed == [7, 11, 15]


def test_memory_profiling_step_runs_the_whole_budget_through_the_runner(tiny_llama):
    """The step that sizes the KV pool on a GPU (workers/gpu_memory.py), run here on the
    CPU: every token of the budget is scheduled, every request samples."""
    from workers.gpu_memory import profiling_step
    from workers.model_runner import KVCacheShape, ModelRunner

    llm = LLM(str(tiny_llama), num_kv_blocks=8)
    executor = llm.engine.core.executor
    step, num_blocks = profiling_step(max_num_batched_tokens=50, max_num_seqs=8, block_size=4)
    assert step.total_num_scheduled_tokens == 50 and len(step.new_requests) == 8
    spec = executor.kv_cache_spec
    runner = ModelRunner(executor.model, KVCacheShape(spec.num_layers, num_blocks, 4, spec.num_kv_heads,
                                                      spec.head_dim, executor.kv_cache_dtype))
    output = runner.execute(step)
    assert sorted(output.sampled_token_ids) == sorted(r.request_id for r in step.new_requests)
    assert all(len(lp.top) == 20 for lp in output.logprobs.values())


def test_the_triton_backend_on_a_cpu_needs_the_interpreter(tiny_llama, monkeypatch):
    """Without it the first step would fail deep in Triton ("0 active drivers"): the engine
    refuses at start instead, naming the way out."""
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(str(tiny_llama), num_kv_blocks=8, attention_backend="triton")


def test_graph_options_that_contradict_each_other_are_refused():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="padded-eager"):
        EngineConfig(attention_backend="torch", decode_graphs="padded-eager")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8")
