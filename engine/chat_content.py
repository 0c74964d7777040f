"""Conversations whose messages carry content parts: text, images and audio.

The model's chat template writes its own placeholder wherever a message has an
`{"type": "image"}` or `{"type": "audio"}` part (as Hugging Face multimodal templates expect);
the images and clips themselves are collected in order, to be decoded and preprocessed off the
event loop. The offline `LLM.chat` and the server take the same part types:
`{"type": "text", "text": ...}`, `{"type": "image_url", "image_url": {"url": ...}}`,
`{"type": "image", "image": <PIL.Image or bytes or URL>}`, Realtime's
`{"type": "input_image", "image_url": ...}`, and `{"type": "audio", "audio": (samples, rate)}`
(the server decodes `input_audio` parts into these for a model that hears).
"""

from __future__ import annotations

IMAGE_PART_TYPES = ("image_url", "image", "input_image")
TEXT_PART_TYPES = ("text", "input_text", "output_text")


def split_media(messages: list[dict]) -> tuple[list[dict], list, list]:
    """(messages for the chat template, image sources, audio clips), each in prompt order. A
    conversation without either comes back with each message's text parts joined into one
    string, which text-only templates expect. Raises ValueError naming a malformed part."""
    sources: list = []
    clips: list = []
    templated: list[dict] = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if content is None or isinstance(content, str):
            templated.append(dict(message))
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{index}].content must be a string or a list of parts")
        parts = []
        for part_index, part in enumerate(content):
            where = f"messages[{index}].content[{part_index}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PART_TYPES:
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{where}.text must be a string")
                parts.append({"type": "text", "text": text})
            elif kind in IMAGE_PART_TYPES:
                sources.append(_image_source(part, where))
                parts.append({"type": "image"})
            elif kind == "audio":
                if part.get("audio") is None:
                    raise ValueError(f"{where} has no audio")
                clips.append(part["audio"])
                parts.append({"type": "audio"})
            else:
                raise ValueError(f"{where} has an unsupported type {kind!r}")
        templated.append({**message, "content": parts})
    if not sources and not clips:
        for message in templated:
            if isinstance(message.get("content"), list):
                message["content"] = "".join(p["text"] for p in message["content"])
    return templated, sources, clips


def _image_source(part: dict, where: str):
    if part["type"] == "image":
        source = part.get("image")
    else:
        source = part.get("image_url")
        if isinstance(source, dict):
            source = source.get("url")
    if source is None:
        raise ValueError(f"{where} has no image")
    return source
