"""Tiny random-weight checkpoints of real architectures, built in a test session.

The tokenizer is a byte-level BPE trained on the spot with `tokenizers`, wrapped as a
transformers fast tokenizer with a ChatML template, so prompts, chat and detokenization
all run through the real code paths.
"""

from __future__ import annotations

from pathlib import Path

import json

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM, GraniteConfig,
                          GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Once upon a time there was a small engine that served many requests at once.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c\u8a9e, emoji \U0001F600 and other multi-byte text.",
    "Streaming tokens over websockets, with prefix caching and chunked prefill.",
] * 20


def build_tokenizer(vocab_size: int = 384, eos_token: str = "<|im_end|>") -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token,
                                      pad_token="<|endoftext|>", bos_token=None)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


# Families by name: (config class, model class, what the family needs beyond the common sizes).
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "mistral": (MistralConfig, MistralForCausalLM, {}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"head_dim": 16}),
    "granite": (GraniteConfig, GraniteForCausalLM, {}),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
}


def build_model(arch: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0, **config):
    """A random-weight model of the family `arch`; `config` overrides its config values."""
    config_class, model_class, family = FAMILIES[arch]
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        # Wider than the default 0.02 so logits are decisive and greedy choices are not ties.
        initializer_range=0.2, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return model_class(config_class(**{**common, **family, **config}))


def save_tiny_checkpoint(arch: str, folder: Path, random_biases: bool = False, **config) -> Path:
    """`random_biases`: the linear layers' biases drawn at random (transformers initializes them
    to zero, under which a kernel that drops or misplaces its bias would go unseen)."""
    tokenizer = build_tokenizer()
    model = build_model(arch, tokenizer, **config)
    if random_biases:
        generator = torch.Generator().manual_seed(0)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                with torch.no_grad():
                    module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# A ChatML checkpoint whose tokenizer's EOS is <|endoftext|> while generation_config.json ends
# turns on <|im_end|> too, as Qwen2 and Llama 3 checkpoints do. Greedy, the tiny Llama's 20th
# token for this conversation is <|im_end|>: an engine that stops only on the tokenizer's EOS
# runs past it.
MULTI_EOS_CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]


def save_multi_eos_checkpoint(folder: Path) -> Path:
    tokenizer = build_tokenizer(eos_token="<|endoftext|>")
    model = build_model("llama", tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    eos_ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    generation_config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation_config, "eos_token_id": eos_ids}))
    return folder
