"""Qwen2.5-Omni's talker and codec: the thinker's rows -> codec tokens -> a waveform.

The talker is an autoregressive decoder (Qwen2 layers, M-RoPE) whose input at each position is
a row the thinker made plus, from the end of the prompt on, the embedding of a codec token
(transformers' Qwen2_5OmniForConditionalGeneration.generate is the reference):

    position p < P (the thinker's prompt):  row(p)
    position P:                             text-bos embedding of the speaker + codec pad
    position P + 1 + j:                     row(generated token j) + codec bos (j = 0) or code j-1

After the thinker's last forwarded token the rows are its text-eos embedding, then its pad
embedding for as long as the talker speaks; every input goes through a projection to the
talker's width. `TalkerInputs` builds this stream; `OmniTalker` is the model the engine's
runner drives; `OmniCodec` turns a whole answer's codes into its waveform.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (Qwen2_5OmniPreTrainedModel,
                                                                    Qwen2_5OmniTalkerForConditionalGeneration,
                                                                    Qwen2_5OmniToken2WavModel)

from engine.adapters.base import load_weights_into


class OmniTalker(Qwen2_5OmniPreTrainedModel):
    """The talker alone, under the checkpoint's names; forward(inputs_embeds, position_ids,
    logits_to_keep) -> .logits (float32) over the codec vocabulary, as the runner drives any
    model. `inputs_embeds` are at the thinker's width: the projection is applied here."""

    _keys_to_ignore_on_load_unexpected = [r"^thinker\.", r"^token2wav\."]

    def __init__(self, config):
        super().__init__(config)
        self.talker = Qwen2_5OmniTalkerForConditionalGeneration._from_config(config.talker_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.talker.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.talker.codec_head

    def rows_input(self, rows: torch.Tensor, from_items: torch.Tensor | None) -> torch.Tensor:
        """The thinker's rows as the talker adds them to its codec embeddings: as they are (the
        projection to the talker's width follows the sum; an item's rows are already its
        reading by the thinker, its embedding zeroed: Qwen2_5OmniAdapter.talker_rows)."""
        return rows

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = False,
                logits_to_keep: torch.Tensor | int = 0, **kwargs) -> CausalLMOutputWithPast:
        talker = self.talker
        hidden = talker.model(inputs_embeds=talker.thinker_to_talker_proj(inputs_embeds), position_ids=position_ids,
                              use_cache=use_cache, **kwargs).last_hidden_state
        kept = hidden[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else hidden[:, logits_to_keep]
        return CausalLMOutputWithPast(logits=talker.codec_head(kept).float())


class OmniCodec(Qwen2_5OmniPreTrainedModel):
    """Token2Wav alone (a DiT from noise to a mel spectrogram, then BigVGAN), float32 as
    transformers runs it, with the checkpoint's speakers."""

    _keys_to_ignore_on_load_unexpected = [r"^thinker\.", r"^talker\."]

    def __init__(self, config):
        super().__init__(config)
        self.token2wav = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config)
        self.post_init()

    def waveform(self, codes: list[int], speaker: dict, seed: int | None = None) -> torch.Tensor:
        """A whole answer's waveform [samples], float32 at 24 kHz. The DiT starts from noise:
        drawn after `seed` when given (the same codes and seed, the same waveform), else from
        the process's generator, as transformers draws it."""
        device = next(self.parameters()).device
        code = torch.tensor([codes], dtype=torch.long, device=device)
        devices = [device] if device.type == "cuda" else []
        with torch.inference_mode(), torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            wav = self.token2wav(code, conditioning=speaker["cond"].to(device).float(),
                                 reference_mel=speaker["ref_mel"].to(device).float())
        return wav.reshape(-1).float().cpu()

    def stream(self, speaker: dict, seed: int | None = None):
        """An answer's audio as its codes come (engine/adapters/qwen2_5_omni_codec_stream.py)."""
        from engine.adapters.qwen2_5_omni_codec_stream import CodecStream

        return CodecStream(self, speaker, seed=seed)


class ThinkerEmbeddings(Qwen2_5OmniPreTrainedModel):
    """The thinker's token embeddings alone, for a talker process that has no thinker: the
    talker's row stream uses a few of them (text-bos, -eos, -pad)."""

    _keys_to_ignore_on_load_unexpected = [r"^thinker\.(?!model\.embed_tokens\.)", r"^talker\.", r"^token2wav\."]

    def __init__(self, config):
        super().__init__(config)
        text = config.thinker_config.text_config
        self.thinker = nn.Module()
        self.thinker.model = nn.Module()
        self.thinker.model.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.thinker.model.embed_tokens


class TalkerSpec:
    """What the talker stage needs to know of the checkpoint: its special tokens, its speakers,
    the thinker embeddings its row stream uses, and how to load its two models."""

    # Qwen2.5-Omni's codec makes 24 kHz audio, a code at a time (no code groups).
    sample_rate = 24000
    num_code_groups = 1

    def __init__(self, model_path: Path, hf_config, thinker_embeddings: nn.Module) -> None:
        self.model_path = Path(model_path)
        talker = hf_config.talker_config
        self.codec_bos, self.codec_eos = talker.tts_codec_start_token_id, talker.tts_codec_end_token_id
        self.codec_pad, self.codec_mask = talker.tts_codec_pad_token_id, talker.tts_codec_mask_token_id
        self.speakers = torch.load(self.model_path / "spk_dict.pt", weights_only=True)
        with torch.inference_mode():
            ids = torch.tensor([talker.tts_text_end_token_id, talker.tts_text_pad_token_id])
            weight_device = thinker_embeddings.weight.device
            self.text_eos, self.text_pad = thinker_embeddings(ids.to(weight_device)).float().cpu()
            self.text_bos = {name: thinker_embeddings(torch.tensor([params["bos_token"]], device=weight_device))
                             .float().cpu()[0] for name, params in self.speakers.items()}

    @classmethod
    def from_checkpoint(cls, model_path: Path, thinker_embeddings: nn.Module | None = None) -> "TalkerSpec":
        """The spec of an omni folder; without the thinker's embeddings, they are read from it."""
        from transformers import AutoConfig

        if thinker_embeddings is None:
            thinker_embeddings = load_weights_into(ThinkerEmbeddings, Path(model_path), torch.float32,
                                                   "cpu").get_input_embeddings()
        return cls(model_path, AutoConfig.from_pretrained(model_path), thinker_embeddings)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The codes that end an answer (generate's talker_eos_token_id: pad and end)."""
        return (self.codec_pad, self.codec_eos)

    def talker_params(self, params):
        """`params` for the talker: it stops at the codec's pad or end code (whatever `ignore_eos`
        said), and never says its codec-bos code (a bias of -100: transformers' suppress_tokens
        sets -inf, which OpenAI's bias range excludes)."""
        import msgspec

        return msgspec.structs.replace(params, stop_token_ids=list(self.stop_token_ids), ignore_eos=False,
                                       logit_bias={**params.logit_bias, self.codec_bos: -100.0})

    def prompt_token_ids(self, num_kept: int, speaker: str) -> list[int]:
        return [self.codec_mask] * num_kept + [self.codec_pad, self.codec_bos]

    def start_rows(self, speaker: str) -> torch.Tensor:
        """The text rows between the prompt's rows and the reply's: the speaker's text-bos."""
        return self.text_bos[speaker].unsqueeze(0)

    def load_talker(self, dtype: torch.dtype, device, attn_implementation: str) -> OmniTalker:
        model = load_weights_into(OmniTalker, self.model_path, dtype, device)
        model.talker.model.config._attn_implementation = attn_implementation
        return model

    def load_codec(self, device) -> OmniCodec:
        return load_weights_into(OmniCodec, self.model_path, torch.float32, device)
