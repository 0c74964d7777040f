"""--kv-cache-dtype: auto caches the model's dtype; bfloat16 on a float32 CPU model is what
attention sees everywhere: the engine's greedy tokens equal transformers' with keys and values
rounded to bfloat16, whatever the chunking, prefix-cache hits or batch. The C++ stack's cache
writes round as torch does, and a budget holds twice the blocks."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.perplexity import attention_over_rounded_keys
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.test_greedy_parity import MAX_TOKENS, make_prompts
from tests.test_lean_decoder import attends_natively
from workers.cpu import native_library
from workers.kv_cache_dtype import resolve_kv_cache_dtype
from workers.paged_attention import PagedAttentionMetadata, PrefillSpan, attend, prefill_attention


def kv_dtype(llm: LLM) -> torch.dtype:
    caches = llm.engine.core.executor.runner.kv_caches
    assert len({cache.dtype for pair in caches for cache in pair}) == 1
    return caches[0][0].dtype


@pytest.mark.parametrize("mode", ["none", "bf16", "int8", "int4"])
def test_auto_caches_the_models_dtype_and_bfloat16_serves_every_mode(tiny_llama, mode):
    assert kv_dtype(LLM(str(tiny_llama), quantization=mode, num_kv_blocks=64)) == torch.float32
    llm = LLM(str(tiny_llama), quantization=mode, num_kv_blocks=64, kv_cache_dtype="bfloat16")
    assert kv_dtype(llm) == torch.bfloat16
    # The native decode attention reads it where the layers are native (4-bit, exact mode's float32).
    assert llm.engine.core.executor.runner.native_attention == attends_natively(mode)
    output = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(output.token_ids) == 5


def test_a_budget_holds_twice_the_blocks_in_bfloat16(tiny_llama):
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(tiny_llama), quantization="none", kv_cache_dtype=dtype, kv_cache_memory_gib=0.001)
        assert kv_dtype(llm) == getattr(torch, dtype)
        sizes[dtype] = llm.engine.core.sizes.num_kv_blocks
    assert sizes["bfloat16"] == 2 * sizes["float32"], sizes


def test_a_dtype_other_than_the_models_is_served_on_cpu_with_torch_attention_only(caplog, tiny_llama):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for device, backend in ((cuda, "triton"), (cuda, "torch"), (cpu, "triton")):
        with pytest.raises(ValueError, match="torch attention on CPU only"):
            resolve_kv_cache_dtype("bfloat16", torch.float32, device, backend)
        # The model's own dtype, or auto, anywhere.
        assert resolve_kv_cache_dtype("float32", torch.float32, device, backend) == torch.float32
        assert resolve_kv_cache_dtype("auto", torch.float16, device, backend) == torch.float16
    with caplog.at_level(logging.WARNING, logger="antiphon"):
        assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu, "torch") == torch.bfloat16
    assert "may differ from transformers" in caplog.text
    for bad in ("fp8", "float16"):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            EngineConfig(kv_cache_dtype=bad)
    # The engine refuses it before loading any weights.
    from workers import inprocess_executor

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inprocess_executor, "load_model", no_load)
        with pytest.raises(ValueError, match="torch attention on CPU only"):
            LLM(str(tiny_llama), kv_cache_dtype="bfloat16", attention_backend="triton")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def rounded_case(request, tiny_checkpoints):
    """Prompts and transformers' greedy tokens with its SDPA over keys and values rounded to
    bfloat16 (benchmarks/perplexity.py's attention, which scores the modes so)."""
    path = tiny_checkpoints[request.param]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_attn_implementation(attention_over_rounded_keys(torch.bfloat16))
    prompts = make_prompts(model.config.vocab_size)
    expected = []
    for prompt, count in zip(prompts, MAX_TOKENS):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    return path, prompts, expected


@pytest.mark.parametrize("engine_kwargs", [
    dict(),
    dict(max_num_batched_tokens=8),  # chunks resume over cached, rounded keys
    dict(max_num_batched_tokens=24, block_size=4),
    dict(enable_prefix_caching=False),
], ids=["default", "budget-8", "budget-24-block-4", "no-prefix-cache"])
def test_a_bfloat16_cache_gives_transformers_tokens_over_rounded_keys(rounded_case, engine_kwargs):
    """Exact mode's layers with a bfloat16 cache: prompt chunks attend to their own keys
    rounded as the cache holds them, so chunking and prefix-cache hits change nothing."""
    path, prompts, expected = rounded_case
    llm = LLM(str(path), quantization="none", kv_cache_dtype="bfloat16", num_kv_blocks=256, **engine_kwargs)
    assert kv_dtype(llm) == torch.bfloat16
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    # Again (17 and 30 tokens: whole blocks): the prompts' blocks now come from the prefix cache.
    again = llm.generate(prompts[1:3], params[1:3])
    assert [o.token_ids for o in again] == expected[1:3]
    if engine_kwargs.get("enable_prefix_caching", True):
        assert min(o.num_cached_tokens for o in again) > 0


def test_a_first_chunk_attends_to_its_keys_as_the_cache_holds_them():
    """A prompt's first chunk (no cached context) attends to its own keys and values rounded
    to the cache's dtype, as every later read of them will."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, heads, 16, generator=generator) for heads in (4, 2, 2))
    caches = [(torch.zeros(32, 2, 16, dtype=torch.bfloat16), torch.zeros(32, 2, 16, dtype=torch.bfloat16))]
    meta = PagedAttentionMetadata(slot_mapping=torch.arange(7), decode_groups=[],
                                  prefill_spans=[PrefillSpan(0, 7)], kv_caches=caches, max_context_len=7)
    out = attend(meta, 0, q, k, v, 0.25, None)
    rounded = prefill_attention(q, k.bfloat16().float(), v.bfloat16().float(), None, 0.25)
    assert torch.equal(out, rounded)
    assert not torch.equal(out, prefill_attention(q, k, v, None, 0.25))
    assert torch.equal(caches[0][0][:7], k.bfloat16()) and torch.equal(caches[0][1][:7], v.bfloat16())


@pytest.fixture(scope="module")
def write_kv_rows():
    if not native_library.wait_until_built(600):
        pytest.skip("the native library did not build")
    return torch.ops.antiphon_cpu.write_kv_rows


def special_floats() -> torch.Tensor:
    """Values around bfloat16's rounding: ties to even both ways, just off ties, the largest
    floats (round to infinity), infinities, signed zeros, denormals, NaN."""
    bits = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF, 0x00000001,
            0x80008000, 0x00018000, 0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
            0x7F800001]
    values = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([values, torch.randn(48 * 3 - len(bits)) * 1e3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stacks_cache_writes_equal_index_copy(write_kv_rows, dtype):
    # Rows of 3 KV heads x 16 (48 values: three whole AVX-512 chunks), x 6 (one chunk and a
    # tail of two) and x 5 (a tail only).
    for head_dim in (16, 6, 5):
        rows = special_floats()[:3 * 3 * head_dim].view(3, 3, head_dim)
        slots = torch.tensor([7, 2, 11])
        cache, expected = torch.zeros(16, 3, head_dim, dtype=dtype), torch.zeros(16, 3, head_dim, dtype=dtype)
        write_kv_rows(cache, slots, rows)
        expected.index_copy_(0, slots, rows.to(dtype))
        nan = expected.isnan()
        assert torch.equal(cache.isnan(), nan)
        assert torch.equal(cache.view(torch.int16)[~nan], expected.view(torch.int16)[~nan]) if dtype.itemsize == 2 \
            else torch.equal(cache[~nan], expected[~nan])


def test_the_stacks_cache_writes_check_every_slot_before_writing(write_kv_rows):
    cache = torch.zeros(8, 2, 16, dtype=torch.bfloat16)
    rows = torch.ones(3, 2, 16)
    with pytest.raises(RuntimeError, match="out of the cache"):
        write_kv_rows(cache, torch.tensor([1, 2, 8]), rows)
    assert not cache.any()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        write_kv_rows(cache.half(), torch.tensor([1, 2, 3]), rows)
    with pytest.raises(RuntimeError, match="float32"):
        write_kv_rows(cache, torch.tensor([1, 2, 3]), rows.double())
