"""Antiphon's engine: scheduling, paged KV with prefix caching, and the offline API."""

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)
