"""What the engine client raises to its callers, and the voice share that turns into VoiceBusy."""

from __future__ import annotations

from frontend.tenancy import FairShare, Requester, ShareExhausted, ShareSlot


class EngineUnavailable(RuntimeError):
    """The decoder is not running (starting, restarting or failed)."""


class VoiceBusy(EngineUnavailable):
    """As many clips are being recognized, or answers spoken, as the server allows: try later."""


def voice_slot(share: FairShare, requester: Requester) -> ShareSlot:
    try:
        return share.take(requester)
    except ShareExhausted as exc:
        raise VoiceBusy(str(exc)) from None
