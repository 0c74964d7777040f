"""The settings of a Realtime session and of one response, checked where they are set.

A session.update sets the session's fields; a response.create may override them for one
response. Both come in GA or beta names and leave here as one dict under GA names, with the
fields this server does not act on refused unless they ask for nothing, and with sampling,
tools, response_format and include checked before anything changes.
"""

from __future__ import annotations

import msgspec

from engine.sampling_params import SamplingParams
from frontend.chat_request import sampling_params_or_invalid
from frontend.edge_decoding import InvalidInput
from frontend.realtime_audio import default_audio_settings
from frontend.realtime_events import UNSUPPORTED_SESSION_FIELDS, SessionSettings
from frontend.realtime_tools import check_tools, constraint_of
from frontend.structured_output import GrammarBusy
from frontend.tenancy import Requester

SESSION_FIELDS = ("output_modalities", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "tools",
                  "tool_choice", "response_format", "include")


def new_session(session_id: str, model_name: str) -> dict:
    """A session's settings before its first session.update."""
    return {
        "id": session_id, "object": "realtime.session", "type": "realtime", "model": model_name,
        "output_modalities": ["text"], "instructions": "", "max_output_tokens": "inf",
        "temperature": 0.8, "top_p": 1.0, "seed": None, "audio": default_audio_settings(),
        "tools": [], "tool_choice": "auto", "include": None,
    }


def settings_of(settings: SessionSettings, where: str) -> dict:
    """The session fields a session.update / response.create sets, under their GA names; the
    known fields it does not act on are refused when set to anything but a no-op."""
    given = {name: getattr(settings, name) for name in settings.__struct_fields__
             if getattr(settings, name) is not msgspec.UNSET}
    for name, allowed in UNSUPPORTED_SESSION_FIELDS.items():
        if given.get(name) is not None and given[name] not in allowed:
            raise InvalidInput(f"{where}.{name} is not supported by this server", "unsupported_parameter",
                               f"{where}.{name}")
    for name in ("tools", "tool_choice", "response_format"):
        if name in given:
            given[name] = msgspec.to_builtins(given[name])
    if "max_response_output_tokens" in given:  # beta name
        given.setdefault("max_output_tokens", given.pop("max_response_output_tokens"))
    if "modalities" in given:  # beta name
        given.setdefault("output_modalities", given.pop("modalities"))
    return {name: value for name, value in given.items() if name in SESSION_FIELDS}


def check_modalities(settings: dict, param: str) -> None:
    """GA sessions answer in text or in audio (with its transcript), not both at once."""
    modalities = settings.get("output_modalities")
    if modalities is not None and (len(modalities) != 1):
        raise InvalidInput('output_modalities is ["text"] or ["audio"] (audio comes with its transcript)',
                           "invalid_value", param)


def sampling(session: dict, overrides: dict, default_max_tokens: int, where: str = "session") -> SamplingParams:
    """Sampling parameters from the session's settings and a response's overrides; a bad value is
    an InvalidInput naming it under `where` (the session's own were checked when they were set)."""
    settings = {**session, **overrides}
    max_tokens = settings["max_output_tokens"]
    return sampling_params_or_invalid(
        {"temperature": settings["temperature"], "top_p": settings["top_p"], "seed": settings["seed"],
         "max_tokens": default_max_tokens if max_tokens == "inf" else max_tokens},
        {"temperature": f"{where}.temperature", "top_p": f"{where}.top_p", "seed": f"{where}.seed",
         "max_tokens": f"{where}.max_output_tokens"})


async def check_answer_settings(settings: dict, where: str, state, requester: Requester) -> tuple | None:
    """Tools, tool_choice, response_format and include of a session or a response, checked
    (grammars compiled off the loop, by the server's `state.grammar_checker`); the constraint
    its answers get, if any."""
    config = state.config
    for value in settings["include"] or ():
        if value != "response.output_text.logprobs":
            raise InvalidInput(f"include {value!r} is not supported by this server (it can include "
                               "'response.output_text.logprobs')", "unsupported_parameter", f"{where}.include")
    check_tools(settings, where, config.max_tools)
    constraint = await constraint_of(settings, where, config.max_grammar_bytes, state.generation.tool_parser)
    if constraint is not None:
        try:
            await state.grammar_checker.check(*constraint, requester)
        except GrammarBusy as exc:
            raise InvalidInput(str(exc), "grammar_busy", constraint[1]) from None
    return constraint
