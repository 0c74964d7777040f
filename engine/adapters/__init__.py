"""Model adapters by family: how the engine splits a multimodal checkpoint (see base.py)."""

from __future__ import annotations

from pathlib import Path

from engine.adapters.base import ModelAdapter
from engine.adapters.llava import LlavaAdapter
from engine.adapters.qwen2_5_omni import Qwen2_5OmniAdapter
from engine.adapters.qwen2_vl import Qwen2VLAdapter
from engine.adapters.qwen3_omni import Qwen3OmniAdapter

# Keyed by config.json's model_type. Families not listed are text-only: no adapter.
ADAPTERS: dict[str, type[ModelAdapter]] = {
    "qwen2_vl": Qwen2VLAdapter,
    "qwen2_5_vl": Qwen2VLAdapter,
    "llava": LlavaAdapter,
    "qwen2_5_omni": Qwen2_5OmniAdapter,
    "qwen3_omni_moe": Qwen3OmniAdapter,
}


def adapter_for(model_path: Path, hf_config) -> ModelAdapter | None:
    """The adapter for the checkpoint in `model_path`, or None for a text-only family."""
    adapter_class = ADAPTERS.get(hf_config.model_type)
    return adapter_class(Path(model_path), hf_config) if adapter_class else None


def talker_spec(model_path: Path, thinker_embeddings=None):
    """The talker stage's spec of an omni checkpoint (its talker and codec), by family; the
    thinker's embeddings are read from the checkpoint unless given."""
    from transformers import AutoConfig

    family = AutoConfig.from_pretrained(model_path).model_type
    if family == "qwen2_5_omni":
        from engine.adapters.qwen2_5_omni_talker import TalkerSpec as spec_class
    elif family == "qwen3_omni_moe":
        from engine.adapters.qwen3_omni_talker import Qwen3TalkerSpec as spec_class
    else:
        raise ValueError(f"{family} has no talker")
    return spec_class.from_checkpoint(Path(model_path), thinker_embeddings)


__all__ = ["ADAPTERS", "ModelAdapter", "adapter_for", "talker_spec"]
