"""What the offline API returns for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler_output import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # Everything generated so far, and the text without a matched stop string.
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # "stop", "length", "abort" or "error" once finished.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the request, if one did.
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    # What this step added, for streaming.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # A spoken answer (an omni model asked for a voice): the talker's codec tokens and the
    # codec's waveform (float32 mono) at its sample rate.
    codec_token_ids: list[int] | None = None
    audio: object | None = None
    sample_rate: int | None = None
    # Streamed speech (LLM.stream with a voice): the audio chunk this output brings.
    new_audio: object | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
