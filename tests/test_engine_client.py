"""EngineClient with real worker processes (tiny model), and its restart budget."""

import asyncio

import pytest
import pytest_asyncio

from engine import protocol
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from frontend.engine_client import EngineClient
from frontend.engine_errors import VoiceBusy
from frontend.restart_budget import RestartBudget


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- restart budget ---------------------------------------------------------------------

def test_restart_budget_refuses_the_restart_past_the_limit_inside_the_window():
    clock = FakeClock()
    budget = RestartBudget(3, 600.0, clock)
    for _ in range(3):
        assert budget.try_spend()
        clock.now += 10
    assert not budget.try_spend()
    assert budget.recent == 3  # a refusal records nothing


def test_restart_budget_forgives_restarts_older_than_the_window():
    clock = FakeClock()
    budget = RestartBudget(3, 600.0, clock)
    for _ in range(3):
        assert budget.try_spend()
    clock.now += 599
    assert not budget.try_spend()
    clock.now += 1  # the first three are now exactly one window old
    assert budget.recent == 0
    assert budget.try_spend()


def test_restart_budget_of_zero_allows_no_restart():
    assert not RestartBudget(0, 600.0, FakeClock()).try_spend()


# ---- the client with real workers ---------------------------------------------------------

def long_request(request_id: str, prompt=(5, 6, 7, 8)) -> protocol.EngineRequest:
    return protocol.EngineRequest(request_id=request_id, prompt_token_ids=list(prompt),
                                  sampling_params=SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))


async def wait_until(predicate, timeout: float = 30.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(tiny_llama):
    engine = EngineClient(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.mark.asyncio(loop_scope="module")
async def test_request_that_does_not_encode_leaves_no_queue_behind(client):
    broken = protocol.EngineRequest(request_id="broken", prompt_token_ids=[1, object()],
                                    sampling_params=SamplingParams(max_tokens=2))
    with pytest.raises(TypeError):
        await client.add_request(broken)
    assert "broken" not in client.queues
    assert client.num_registered == 0
    # The client still serves.
    queue = await client.add_request(protocol.EngineRequest(
        request_id="after-broken", prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=2)))
    deltas = [await asyncio.wait_for(queue.get(), 30)]
    while deltas[-1].finish_reason is None:
        deltas.append(await asyncio.wait_for(queue.get(), 30))
    assert deltas[-1].finish_reason == "length" and client.num_registered == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_releases_are_idempotent_and_abort_in_one_message(client):
    ids = [f"release-{i}" for i in range(12)]
    for request_id in ids:
        await client.add_request(long_request(request_id, prompt=(5, 6, 7, len(request_id))))
    assert client.num_registered == 12
    assert await wait_until(lambda: client.stats.num_running == 12), client.stats
    sent_before = client.abort_messages_sent
    for request_id in ids + ids:  # the second round finds nothing registered
        client.release(request_id)
    assert client.num_registered == 0
    assert await wait_until(lambda: client.stats.num_running == 0 and client.stats.kv_blocks_used == 0), \
        client.stats
    assert client.abort_messages_sent == sent_before + 1
    # A release after the fact changes nothing and sends nothing.
    client.release(ids[0])
    client.release(ids[1])
    await asyncio.sleep(0.1)
    assert client.abort_messages_sent == sent_before + 1


@pytest.mark.asyncio(loop_scope="module")
async def test_finished_request_is_unregistered_and_its_release_sends_no_abort(client):
    queue = await client.add_request(protocol.EngineRequest(
        request_id="short", prompt_token_ids=[9, 10], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True)))
    while (await asyncio.wait_for(queue.get(), 30)).finish_reason is None:
        pass
    assert client.num_registered == 0
    sent_before = client.abort_messages_sent
    client.release("short")
    await asyncio.sleep(0.1)
    assert client.abort_messages_sent == sent_before


async def test_dead_output_reader_fails_requests_turns_unhealthy_and_is_fatal(tiny_llama):
    fatal = []
    engine = EngineClient(EngineConfig(model=str(tiny_llama), num_kv_blocks=64), on_fatal=lambda: fatal.append(1))
    await engine.start()
    try:
        queue = await engine.add_request(long_request("doomed"))
        engine.supervisor.reader.cancel()
        delta = await asyncio.wait_for(queue.get(), 10)
        assert delta.finish_reason == "error" and "worker-outputs" in delta.error
        assert not engine.healthy and "worker-outputs" in engine.status
        assert fatal == [1]
        assert engine.num_registered == 0
    finally:
        await engine.shutdown()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_transcription_its_caller_gave_up_holds_its_share_until_the_encoder_answers(tiny_llama):
    import numpy as np

    from frontend.tenancy import Requester

    engine = EngineClient(EngineConfig(model=str(tiny_llama), voice=True), max_transcriptions=4,
                          share_per_client=0.25)
    sent = []

    async def to_encoder(worker, frames, block=True):
        sent.append(worker)

    engine.supervisor.send = to_encoder
    client = Requester(tenant="", client="10.0.0.7")
    try:
        waiter = asyncio.ensure_future(engine.transcribe(np.zeros(1600, np.float32), client))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.sleep(0.01)
        # The encoder still recognizes the clip: the client's one share stays taken.
        assert sent == ["encoder"] and engine.transcriptions.held == 1
        with pytest.raises(VoiceBusy):
            await engine.transcribe(np.zeros(1600, np.float32), client)
        engine._route(protocol.AudioTranscript(request_id="clip-0", text="late"))
        await asyncio.sleep(0)  # done-callbacks run on the loop's next turn
        assert engine.transcriptions.held == 0 and not engine.encoder.transcripts
    finally:
        await engine.shutdown()
