"""The decoder process: the scheduler, the KV cache and the model runner in one loop.

It pulls requests and aborts from the frontend, runs engine steps while there is work, and
pushes one StepOutputs message per step. Requests the engine refuses (too long, pool too
small) come back at once as an error delta; they never crash the loop.

For a multimodal model the decoder asks the encoder process for item embeddings and
receives them on its own socket (workers/remote_encoder.py); while every request waits for
the encoder, the loop sleeps on its sockets instead of spinning.

For an omni model whose answers are spoken (`omni_speech`), the decoder hands each spoken
answer's thinker rows to the talker process after every step (workers/thinker_rows_sender.py).

Run by the frontend as `python -m workers.decoder_process --config JSON --input ADDR
--output ADDR --encoder-asks ADDR --embeddings ADDR --thinker-rows ADDR`.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from engine import link_keys, protocol
from engine.config import EngineConfig
from engine.input_processor import to_request
from engine.warm_up import warm_up
from workers import heap
from workers.worker_loop import worker_main

logger = logging.getLogger("antiphon.decoder")

# How long an idle decoder waits on its input socket before looking again (ms): it must
# send a heartbeat at least every HEARTBEAT_INTERVAL_S.
IDLE_POLL_MS = int(protocol.HEARTBEAT_INTERVAL_S * 1000)

# On CPU the decoder shares the cores with the frontend, and torch's OpenMP threads spin on
# every core while a step runs. A first token that leaves just as the next step starts then
# waits for CPU time in the frontend and in the client (measured: +2 to +8 ms TTFT). So after
# a step that gives some request its first token, the decoder waits this long (taking any
# new request that arrives meanwhile) before the next step: once per request, not per token.
FIRST_TOKEN_HANDOFF_MS = 2

# With work that waits only on the encoder, the loop wakes on any message or after this long
# (to run the scheduler's timeout checks).
WAIT_FOR_ENCODER_MS = 100
GRAMMAR_POLL_MS = 2


class DecoderWorker:
    def __init__(self, config: EngineConfig, input_address: str, output_address: str,
                 encoder_asks_address: str | None = None, embeddings_address: str | None = None,
                 thinker_rows_address: str | None = None) -> None:
        self.context = zmq.Context()
        self.inputs = self.context.socket(zmq.PULL)
        link_keys.connect(self.inputs, input_address)
        self.outputs = self.context.socket(zmq.PUSH)
        link_keys.connect(self.outputs, output_address)
        self.encoder_addresses = (encoder_asks_address, embeddings_address)
        self.remote_encoder = None
        self.thinker_rows_address = thinker_rows_address
        self.rows_sender = None
        self.poller = zmq.Poller()
        self.poller.register(self.inputs, zmq.POLLIN)
        self.config = config
        self.core = None
        self.handoff_ms = 0
        # Requests that have not produced a token yet.
        self._awaiting_first: set[str] = set()
        self._last_sent = time.monotonic()
        # Whether steps ran since the work last drained (workers/heap.py).
        self._stepped = False

    def load(self) -> None:
        from engine.core import EngineCore
        from workers.inprocess_executor import InProcessExecutor

        if self.config.decoder_threads is not None:
            import torch

            torch.set_num_threads(self.config.decoder_threads)

        # The same core around the same executor as the offline LLM; the vision tower lives
        # in the encoder process.
        executor = InProcessExecutor(self.config, with_encoder=False)
        if executor.adapter is not None and all(self.encoder_addresses):
            from workers.remote_encoder import RemoteEncoder

            self.remote_encoder = RemoteEncoder(self.context, *self.encoder_addresses)
            self.poller.register(self.remote_encoder.embeddings, zmq.POLLIN)
        self.core = EngineCore(self.config, executor, self.remote_encoder)
        if executor.runner.hidden_store is not None and self.thinker_rows_address:
            from workers.thinker_rows_sender import ThinkerRowsSender

            self.rows_sender = ThinkerRowsSender(self.context, self.thinker_rows_address, executor.runner,
                                                 executor.adapter)
        self.handoff_ms = 0 if executor.is_accelerated else FIRST_TOKEN_HANDOFF_MS
        seconds = warm_up(self.core)
        if seconds:
            logger.info("warmed up in %.2f s (two short requests, so the first user's is not the first)", seconds)
        if self.config.publish_cache_events:
            # From here on: the warm-up's blocks are nobody's prefix.
            self.core.kv.pool.record_events()
        self.outputs.send(protocol.encode(protocol.WorkerReady(
            worker="decoder", pid=os.getpid(), max_model_len=self.core.sizes.max_model_len,
            num_kv_blocks=self.core.sizes.num_kv_blocks, encoder_budget=self.core.sizes.encoder_budget,
            vocab_size=executor.vocab_size)))

    def run(self) -> None:
        timeout = IDLE_POLL_MS
        while True:
            # Block while idle; with work in flight, only take what has already arrived
            # (or what arrives during a first-token hand-off).
            # (Embeddings that arrive are taken by the core's next step.)
            while self.inputs in dict(self.poller.poll(timeout)):
                if not self._handle(protocol.decode_input(self.inputs.recv())):
                    return
                timeout = 0
            if self.core.has_unfinished_requests:
                self._stepped = True
                gave_first_tokens = self._step()
                timeout = self.handoff_ms if gave_first_tokens else 0
                if self.core.last_step_was_empty:
                    # Every request waits for the encoder (sleep until something arrives) or
                    # for its grammar to compile (milliseconds: look again soon).
                    timeout = GRAMMAR_POLL_MS if self.core.scheduler.waiting_on_grammar else WAIT_FOR_ENCODER_MS
            else:
                timeout = IDLE_POLL_MS
                if self._stepped:
                    # The work drained: what its steps freed goes back to the system.
                    self._stepped = False
                    heap.trim()
                if self.remote_encoder is not None:
                    self.remote_encoder.poll()  # late embeddings of requests that ended: nobody needs them
            # Sent from this loop, never from a side thread: a loop that hangs stops beating.
            if time.monotonic() - self._last_sent >= protocol.HEARTBEAT_INTERVAL_S:
                self._send_message(protocol.Heartbeat(worker="decoder", pid=os.getpid()))

    def _handle(self, message) -> bool:
        if isinstance(message, protocol.EngineRequest):
            self._add(message)
        elif isinstance(message, protocol.AbortRequests):
            self.core.abort_requests(message.request_ids)
            if self.rows_sender is not None:
                self.rows_sender.aborted(message.request_ids)
            self._awaiting_first.difference_update(message.request_ids)
            # Freed blocks must show in the stats even if no step follows.
            self._send([])
        elif isinstance(message, protocol.EncoderLost):
            self.core.scheduler.fail_items_in_flight(message.reason)
        elif isinstance(message, protocol.Shutdown):
            return False
        return True

    def _add(self, message: protocol.EngineRequest) -> None:
        try:
            talker_prompt = None
            if message.speech is not None:
                if self.rows_sender is None:
                    raise ValueError("this model does not speak its answers (an omni model with voice on does)")
                talker_prompt = self.rows_sender.talker_prompt(message)
            self.core.add_request(to_request(message))
            self._awaiting_first.add(message.request_id)
        except ValueError as exc:
            self._send([protocol.RequestDelta(message.request_id, [], "error", error=str(exc))])
            return
        if talker_prompt is not None:
            self.rows_sender.add(message.request_id, message, talker_prompt)

    def _step(self) -> bool:
        """Runs one engine step and sends its outputs; True if some request got its first token."""
        deltas = []
        gave_first_tokens = False
        outputs = self.core.step()
        for out in outputs:
            if out.new_token_ids and out.request_id in self._awaiting_first:
                gave_first_tokens = True
            if out.new_token_ids or out.finish_reason is not None:
                self._awaiting_first.discard(out.request_id)
            logprobs = None
            if out.logprobs:
                logprobs = [protocol.TokenLogprob(lp.sampled_logprob, lp.top) for lp in out.logprobs]
            deltas.append(protocol.RequestDelta(out.request_id, out.new_token_ids, out.finish_reason,
                                                out.stop_reason, out.num_cached_tokens, out.error, logprobs))
        self._send(deltas)
        if self.rows_sender is not None:
            # After the text: no text waits on speech. The store keeps the rows until the next
            # step, which this loop has not scheduled yet.
            self.rows_sender.after_step(outputs)
        return gave_first_tokens

    def _send(self, deltas: list) -> None:
        changes = self.core.kv.pool.take_events()
        if changes is not None:
            changes = protocol.PrefixCacheChanges(*changes)
        self._send_message(protocol.StepOutputs(deltas, self.core.stats(), changes))

    def _send_message(self, message) -> None:
        self.outputs.send(protocol.encode(message))
        self._last_sent = time.monotonic()

    def close(self) -> None:
        if self.core is not None:
            self.core.close()
        if self.remote_encoder is not None:
            self.remote_encoder.close()
        if self.rows_sender is not None:
            self.rows_sender.close()
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        self.context.term()


def main() -> None:
    worker_main("decoder", lambda config, addresses: DecoderWorker(
        config, addresses.input, addresses.output, addresses.encoder_asks, addresses.embeddings,
        addresses.thinker_rows))


if __name__ == "__main__":
    main()
