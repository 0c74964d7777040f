"""Byte-level BPE vocabularies (GPT-2's scheme, used by Llama 3, Qwen, SmolLM): each of a
token's symbols stands for one byte, so a token's exact bytes can be read from its symbols."""

from __future__ import annotations


def is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, symbol -> byte: printable bytes stand for themselves,
    the others are shifted past 255."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    symbols, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[chr(byte)] = byte
        else:
            symbols[chr(256 + shift)] = byte
            shift += 1
    return symbols
