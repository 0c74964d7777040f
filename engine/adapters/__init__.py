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


__all__ = ["ADAPTERS", "ModelAdapter", "adapter_for"]
