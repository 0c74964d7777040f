"""A random-weight miniature of the default model, for timing the serving path alone.

Same architecture (Llama), same tokenizer and chat template as the embedded SmolLM2, but
2 layers of width 64: a forward pass takes about a millisecond, so a TTFT comparison
between the server and the offline engine measures what the path adds (HTTP, WebSocket,
templating, ZeroMQ, detokenization) instead of a few percent of a 100-300 ms prefill,
which differs that much between two processes on the same machine.

Built once into the cache directory (generated models never go into the repo).
"""

from __future__ import annotations

import shutil
from pathlib import Path

MINIATURE_NAME = "SmolLM2-miniature-2x64"


def ensure_miniature() -> Path:
    from engine.checkpoint import cache_dir, ensure_default_model, file_lock

    target = cache_dir() / "models" / MINIATURE_NAME
    if (target / "config.json").is_file():
        return target
    source = ensure_default_model()
    with file_lock(target.parent / f".{MINIATURE_NAME}.lock"):  # a benchmark and a test may race
        if not (target / "config.json").is_file():
            _build(source, target)
    return target


def _build(source: Path, target: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    reference = LlamaConfig.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=reference.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=reference.max_position_embeddings,
        bos_token_id=reference.bos_token_id, eos_token_id=reference.eos_token_id,
        pad_token_id=reference.pad_token_id, tie_word_embeddings=True,
        rope_parameters=reference.rope_parameters)
    torch.manual_seed(0)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(staging)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, staging / name)
    staging.rename(target)  # a complete folder or none: an interrupted build is redone


if __name__ == "__main__":
    print(ensure_miniature())
