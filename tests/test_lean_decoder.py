"""The lean CPU forward (workers/lean_decoder.py) gives bitwise the logits of the model's own
forward, in every CPU mode, on every kind of step the engine schedules."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.tiny_models import save_tiny_checkpoint
from workers import cpu_linear
from workers.lean_decoder import LeanDecoder, lean_decoder_for
from workers.model_runner import ModelRunner


@pytest.fixture(scope="module")
def qwen2_with_sliding_layers(tmp_path_factory):
    """Qwen2 with q/k/v biases and a sliding-window layer whose window every context fits."""
    return save_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2-sliding") / "qwen2",
                                use_sliding_window=True, sliding_window=4096, max_window_layers=1)


def run_both_forwards(monkeypatch, llm: LLM) -> list[tuple[int, bool]]:
    """Every step runs through both forwards; returns (rows computed, logits bitwise equal)
    per step. The KV cache writes are the same values twice when the two agree."""
    runner = llm.engine.core.executor.runner
    assert isinstance(runner.lean, LeanDecoder)
    steps = []
    lean_forward = ModelRunner._forward

    def both(self, batch, states):
        lean = lean_forward(self, batch, states)
        self.lean, saved = None, self.lean
        try:
            model = lean_forward(self, batch, states)
        finally:
            self.lean = saved
        steps.append((len(batch.input_ids), torch.equal(lean, model)))
        return lean
    monkeypatch.setattr(ModelRunner, "_forward", both)
    return steps


@pytest.mark.parametrize("mode", ["none", "bf16", "int4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_forward_gives_the_models_logits_bitwise(tiny_checkpoints, arch, mode, monkeypatch):
    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16", lambda: True)
    # Chunks of at most 24 tokens: prefill chunks resume over cached keys.
    llm = LLM(str(tiny_checkpoints[arch]), quantization=mode, num_kv_blocks=256, max_num_batched_tokens=24)
    steps = run_both_forwards(monkeypatch, llm)
    shared = list(range(3, 40))
    prompts = [shared + [i, i + 1] for i in range(11)] + [[7, 8, 9]]
    # 12 streams: decode steps above MAX_INT4_ROWS (the batched copy), and fewer as they end.
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(12)]
    llm.generate(prompts, params)
    # Again: the shared prefix now comes from the prefix cache.
    llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert all(equal for _, equal in steps), steps
    sizes = {rows for rows, _ in steps}
    assert 1 in sizes and max(sizes) > 8 and len(steps) > 20


def test_sliding_window_layers_take_the_lean_forward_and_pass_their_window(qwen2_with_sliding_layers, monkeypatch):
    llm = LLM(str(qwen2_with_sliding_layers), num_kv_blocks=64)
    runner = llm.engine.core.executor.runner
    assert [layer.sliding_window for layer in runner.lean.layers] == [None, 4096]
    steps = run_both_forwards(monkeypatch, llm)
    llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert steps and all(equal for _, equal in steps)


def test_other_models_keep_their_own_forward(tmp_path):
    mistral = save_tiny_checkpoint("mistral", tmp_path / "mistral")
    llm = LLM(str(mistral), num_kv_blocks=64)
    assert llm.engine.core.executor.runner.lean is None
    assert lean_decoder_for(torch.nn.Linear(2, 2)) is None
