"""Data-parallel serving: N replicas behind one router, with EngineClient's interface.

A replica is one EngineClient: its own decoder (engine core, KV pool, prefix cache), its own
encoder (and talker, with voice on), each process started by the replica's supervisor through a
launcher (frontend/launchers.py: local processes, or Ray actors). The replica's decoder
publishes its prefix cache's changes with every step and its encoder its cache's changes
(EngineConfig.publish_cache_events); ReplicaRouter (frontend/replica_router.py) turns them into
a choice per request.

What goes where:
- a request: the router's choice, from its prompt's block hashes, its items and its
  conversation (a Realtime session); its release, abort and deltas stay with that replica;
- an omni model's spoken request: routed as any request (among the replicas whose talker is
  up), and its speech bound to that replica's talker (its decoder hands it the rows); a cascade
  answer's text: the replica whose talker speaks the fewest answers, when its speech opens;
- a clip to transcribe: the replica with the fewest clips in flight.

A replica whose decoder is lost leaves the router at once (its caches forgotten: its successor
starts empty) and its requests fail with the reason (a stream cannot be re-run elsewhere
without repeating tokens the client already has); it rejoins when its supervisor restarts it.
The server fails for good only when every replica has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

import msgspec

from engine import protocol
from engine.block_hash import iter_block_hashes
from engine.config import EngineConfig
from engine.cpu_cores import usable_cores
from frontend.engine_client import EngineClient, fair_shares
from frontend.engine_errors import EngineUnavailable, voice_slot
from frontend.launchers import LocalLauncher
from frontend.replica_router import NoReplica, ReplicaRouter
from frontend.tenancy import ANONYMOUS, Requester, ShareSlot

logger = logging.getLogger("antiphon.frontend")


def replica_config(config: EngineConfig, num_replicas: int, on_one_machine: bool) -> EngineConfig:
    """A replica's engine config: it publishes its cache's changes; on one machine its decoder
    takes its share of the cores (torch's default, a thread per core in every replica, would
    have N pools spinning on the same cores)."""
    threads = config.decoder_threads
    if threads is None:
        # Past one machine (Ray CPU nodes), one thread: a replica's bundle is that many CPUs.
        threads = max(1, usable_cores() // num_replicas) if on_one_machine else 1
    return dataclasses.replace(config, publish_cache_events=True, decoder_threads=threads)


def replica_set(config: EngineConfig, num_replicas: int, policy: str, ray_address: str | None,
                **client_options) -> "ReplicaSet":
    """The server's replicas: local processes, or Ray actors of the cluster at `ray_address`."""
    if config.device.startswith("cuda:"):
        raise ValueError("with --data-parallel-size each replica gets a GPU of its own: give --device cuda "
                         "(or auto), not one device")
    if ray_address is None:
        logger.info("data parallel: %d replicas as local processes, %s routing", num_replicas, policy)
        return ReplicaSet(config, num_replicas, policy=policy, launcher_for=local_launchers(config, num_replicas),
                          **client_options)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SystemExit("--ray-address needs Ray: pip install -e '.[ray]'") from None
    import zmq.asyncio

    from frontend.ray_launcher import RayCluster

    cluster = RayCluster(ray_address, zmq.asyncio.Context.instance(), config.device)
    replica = replica_config(config, num_replicas, on_one_machine=cluster.nodes == 1)
    # A replica on a CPU node takes as many CPUs as its decoder runs threads (one, unless
    # --decoder-threads says, past one machine).
    cluster.cpus_per_replica = replica.decoder_threads or 1
    logger.info("data parallel: %d replicas as Ray actors, %s routing", num_replicas, policy)
    return ReplicaSet(config, num_replicas, policy=policy, launcher_for=cluster.launcher,
                      on_one_machine=cluster.nodes == 1,
                      on_start=cluster.start, on_close=cluster.close, **client_options)


def local_launchers(config: EngineConfig, num_replicas: int):
    """On a CUDA machine each local replica's processes see one GPU of their own (all of them
    on the first would each size a KV pool from the same free memory)."""
    if config.device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(index) for index in range(torch.cuda.device_count())]
    if len(devices) < num_replicas:
        raise ValueError(f"--data-parallel-size {num_replicas} needs a GPU per replica; {len(devices)} visible")
    return lambda index: LocalLauncher({"CUDA_VISIBLE_DEVICES": devices[index]})


def summed(kind: type, snapshots) -> msgspec.Struct:
    """Field by field sum of msgspec structs of counters and gauges (every replica's)."""
    total = kind()
    for snapshot in snapshots:
        for field in kind.__struct_fields__:
            setattr(total, field, getattr(total, field) + getattr(snapshot, field))
    return total


class ReplicaSet:
    def __init__(self, config: EngineConfig, num_replicas: int, *, policy: str = "cache-aware", on_fatal=None,
                 launcher_for=None, on_one_machine: bool = True, on_start=None, on_close=None, max_transcriptions: int = 16,
                 max_spoken_answers: int = 16, share_per_tenant: float = 1.0, share_per_client: float = 1.0,
                 **client_options) -> None:
        """`launcher_for(index)`: the launcher of replica `index`'s processes (None: local
        processes). `client_options`: EngineClient's restart and liveness settings."""
        self.config = config
        self.on_fatal = on_fatal
        self.router = ReplicaRouter(num_replicas, policy)
        self.transcriptions, self.spoken_answers = fair_shares(max_transcriptions, max_spoken_answers,
                                                               share_per_tenant, share_per_client)
        replica = replica_config(config, num_replicas, on_one_machine)
        self.replicas = [
            EngineClient(replica, on_fatal=self._replica_failed, shares=(self.transcriptions, self.spoken_answers),
                         on_cache_changes=lambda message, index=index: self._cache_changed(index, message),
                         on_lost=lambda worker, reason, index=index: self._worker_lost(index, worker, reason),
                         launcher=launcher_for(index) if launcher_for is not None else None, **client_options)
            for index in range(num_replicas)]
        # Request id -> the replica serving it, until it finishes or is released.
        self.owner: dict[str, int] = {}
        self._failed = False
        self._on_start, self._on_close = on_start, on_close
        self._background: set[asyncio.Future] = set()
        self._clips = 0
        self._spoken = 0
        # An omni answer's speech opened and not yet routed: its queue and its share of the talkers.
        self._unbound_speech: dict[str, tuple[asyncio.Queue, ShareSlot]] = {}

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        if self._on_start is not None:
            self._on_start()
        try:
            await asyncio.gather(*(replica.start() for replica in self.replicas))
        except BaseException:
            # The replicas that did start (and the cluster's handler) do not outlive a failed start.
            await self.shutdown()
            raise

    async def shutdown(self) -> None:
        await asyncio.gather(*(replica.shutdown() for replica in self.replicas))
        if self._on_close is not None:
            self._on_close()

    def _replica_failed(self) -> None:
        """One replica failed for good (past its restart budget): its other workers stop (they
        hold a GPU or cores for nothing), the others serve on; the server exits only when none
        is left."""
        for replica in self.replicas:
            if replica.supervisor.failed and not replica.supervisor.closing:
                stopping = asyncio.ensure_future(replica.shutdown())
                self._background.add(stopping)
                stopping.add_done_callback(self._stopped)
        if not self._failed and all(replica.supervisor.failed for replica in self.replicas):
            self._failed = True
            if self.on_fatal is not None:
                self.on_fatal()

    def _stopped(self, task: asyncio.Future) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("a failed replica did not shut down cleanly: %r", task.exception())

    @property
    def healthy(self) -> bool:
        """Serving: at least one replica is ready (/health lists each one)."""
        return any(replica.healthy for replica in self.replicas)

    @property
    def status(self) -> str:
        if all(replica.healthy for replica in self.replicas):
            return "ready"
        down = [f"replica {index}: {replica.status}" for index, replica in enumerate(self.replicas)
                if not replica.healthy]
        return "; ".join(down)

    @property
    def serves_text(self) -> bool:
        return any(replica.serves_text for replica in self.replicas)

    @property
    def ready(self) -> dict[str, protocol.WorkerReady]:
        """The first replica's ready messages (every replica loads the same model)."""
        return self.replicas[0].ready

    @property
    def restarts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for replica in self.replicas:
            for worker, count in replica.restarts.items():
                total[worker] = total.get(worker, 0) + count
        return total

    def replica_health(self) -> list[dict]:
        """For /health: each replica's status and load."""
        return [{"replica": row["replica"], "status": row["status"], "requests_in_flight": row["in_flight"],
                 "kv_usage": round(row["kv_blocks_used"] / max(1, row["kv_blocks_total"]), 4),
                 "prefix_hit_rate": round(row["prefix_hits"] / max(1, row["prefix_queries"]), 4),
                 "encoder_cache_hit_rate": round(row["encoder_hits"] / max(1, row["encoder_queries"]), 4)}
                for row in self.replica_rows()]

    def replica_rows(self) -> list[dict]:
        """Each replica's state and counters (for /health and /metrics)."""
        router = self.router
        rows = []
        for index, replica in enumerate(self.replicas):
            stats, encoder = replica.stats, replica.encoder_stats
            ready = replica.ready.get("decoder")
            # Until its first step a decoder has sent no stats: its pool's size is in its ready message.
            total = stats.kv_blocks_total or (ready.num_kv_blocks if ready is not None else 0)
            rows.append({"replica": index, "status": replica.status, "healthy": int(replica.healthy),
                         "running": stats.num_running, "waiting": stats.num_waiting,
                         "in_flight": router.in_flight[index], "kv_blocks_used": stats.kv_blocks_used,
                         "kv_blocks_total": total,
                         "prefix_blocks_indexed": router.blocks_indexed(index), "routed": router.routed[index],
                         "routed_for_prefix": router.routed_for_prefix[index],
                         "prefix_queries": stats.prefix_cache_query_tokens,
                         "prefix_hits": stats.prefix_cache_hit_tokens, "encoder_queries": encoder.cache_queries,
                         "encoder_hits": encoder.cache_hits, "restarts": sum(replica.restarts.values())})
        return rows

    # ---- requests ----------------------------------------------------------------------

    async def add_request(self, request: protocol.EngineRequest, on_finished=None, items=(),
                          conversation: str | None = None) -> asyncio.Queue:
        """Routes the request (ReplicaRouter's rule) and adds it there; see EngineClient.add_request."""
        if request.request_id in self.owner:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        speech = self._unbound_speech.pop(request.speech.speech_id, None) if request.speech is not None else None
        if request.speech is not None and speech is None:
            raise EngineUnavailable(f"speech {request.speech.speech_id!r} was not opened")
        try:
            index = self._route(request, conversation, needs_encoder=bool(items), needs_talker=speech is not None)
        except BaseException:
            if speech is not None:
                speech[1].release()
            raise
        # From here the request is the replica's: _ended (on any failure below) undoes the routing.
        self.owner[request.request_id] = index
        if speech is not None:
            # An omni answer is spoken by the talker beside the decoder that makes it.
            queue, slot = speech
            try:
                self.replicas[index].talker.open_speech(request.speech.speech_id, queue=queue, slot=slot)
            except BaseException:
                slot.release()
                self._ended(request.request_id)
                raise

        def finished() -> None:
            self._ended(request.request_id)
            if on_finished is not None:
                on_finished()

        try:
            return await self.replicas[index].add_request(request, finished, items)
        except BaseException:
            self._ended(request.request_id)
            raise

    def _route(self, request: protocol.EngineRequest, conversation: str | None, needs_encoder: bool,
               needs_talker: bool = False) -> int:
        router = self.router
        for index, replica in enumerate(self.replicas):
            up = (replica.serves_text and (not needs_encoder or "encoder" in replica.supervisor.running)
                  and (not needs_talker or replica.voice_ready))
            router.set_healthy(index, up)
            # Every front end's requests there, as of its last step.
            router.load_reported(index, replica.stats.num_running + replica.stats.num_waiting)
        # Hashed as the router walks them: it stops at the first block no replica holds.
        hashes = iter_block_hashes(request.prompt_token_ids, request.mm_placeholders, request.cache_salt,
                                   self.config.block_size) if router.policy == "cache-aware" else ()
        mm_hashes = [item.mm_hash for item in request.mm_placeholders]
        try:
            index = router.route(hashes, mm_hashes, conversation)
        except NoReplica:
            raise EngineUnavailable(f"voice unavailable: {self.voice_status}" if needs_talker
                                    else f"engine unavailable: {self.status}") from None
        return index

    def _ended(self, request_id: str) -> None:
        index = self.owner.pop(request_id, None)
        if index is not None:
            self.router.finished(index)

    def release(self, request_id: str) -> None:
        index = self.owner.get(request_id)
        if index is not None:
            self.replicas[index].release(request_id)
            self._ended(request_id)

    @property
    def num_registered(self) -> int:
        return sum(replica.num_registered for replica in self.replicas)

    @property
    def stats(self) -> protocol.EngineStatsSnapshot:
        """Every replica's counters and gauges added up (per replica: replica_stats)."""
        return summed(protocol.EngineStatsSnapshot, (replica.stats for replica in self.replicas))

    # ---- what the replicas publish ------------------------------------------------------

    def _cache_changed(self, index: int, message) -> None:
        if isinstance(message, protocol.PrefixCacheChanges):
            self.router.prefix_changed(index, message.stored, message.evicted, message.cleared)
        else:
            self.router.items_changed(index, message.added, message.evicted)

    def _worker_lost(self, index: int, worker: str, reason: str) -> None:
        if worker == "decoder":
            logger.error("replica %d leaves the router: %s", index, reason)
            # Its last load and gauges are not its successor's.
            self.replicas[index].decoder.stats = protocol.EngineStatsSnapshot()
            # Its successor starts with empty caches; it is routed to again once it serves
            # (_route reads each replica's health).
            self.router.replica_down(index)
        elif worker == "encoder":
            self.router.encoder_down(index)

    # ---- the encoder -------------------------------------------------------------------

    async def transcribe(self, samples, requester: Requester = ANONYMOUS) -> protocol.AudioTranscript:
        serving = [replica for replica in self.replicas if "encoder" in replica.supervisor.running
                   and not replica.supervisor.failed and not replica.supervisor.closing]
        if not serving:
            raise EngineUnavailable(f"engine unavailable: {self.status}")
        # The fewest clips in flight; ties taken in turn.
        self._clips += 1
        turn = self._clips % len(serving)
        replica = min(serving[turn:] + serving[:turn], key=lambda r: len(r.encoder.transcripts))
        return await replica.transcribe(samples, requester)

    @property
    def transcribe_timeout_s(self) -> float:
        return self.replicas[0].transcribe_timeout_s

    @property
    def encoder_stats(self) -> protocol.EncoderStats:
        return summed(protocol.EncoderStats, (replica.encoder_stats for replica in self.replicas))

    @property
    def items_sent_cached(self) -> int:
        return sum(replica.items_sent_cached for replica in self.replicas)

    @property
    def items_resent(self) -> int:
        return sum(replica.items_resent for replica in self.replicas)

    # ---- voice -------------------------------------------------------------------------

    @property
    def voice_ready(self) -> bool:
        return any(replica.voice_ready for replica in self.replicas)

    @property
    def voice_status(self) -> str:
        if self.voice_ready:
            return "ready"
        return self.replicas[0].voice_status

    @property
    def speaks_itself(self) -> bool:
        return self.replicas[0].speaks_itself

    @property
    def voices(self) -> list[str]:
        return self.replicas[0].voices

    def speaker(self, voice: str) -> str:
        return self.replicas[0].speaker(voice)

    def speech_options(self, request_id: str, voice: str, sample_rate: int,
                       seed: int | None = None) -> protocol.SpeechOptions | None:
        return self.replicas[0].speech_options(request_id, voice, sample_rate, seed)

    def _speech_owner(self, request_id: str) -> int | None:
        for index, replica in enumerate(self.replicas):
            if request_id in replica.talker.speech_queues:
                return index
        return None

    def open_speech(self, request_id: str, requester: Requester = ANONYMOUS) -> asyncio.Queue:
        """Opens the answer's speech. The cascade's (Piper speaks the text it is sent) on the
        least-loaded replica with a talker; an omni model's is bound when its request is routed
        (add_request), to the talker beside the decoder the router picks for it."""
        speaking = [index for index, replica in enumerate(self.replicas)
                    if replica.voice_ready and replica.serves_text]
        if not speaking:
            raise EngineUnavailable(f"voice unavailable: {self.voice_status}")
        if self._speech_owner(request_id) is not None or request_id in self._unbound_speech:
            raise ValueError(f"speech {request_id!r} is already in flight")
        if self.speaks_itself:
            queue: asyncio.Queue = asyncio.Queue()
            self._unbound_speech[request_id] = (queue, voice_slot(self.spoken_answers, requester))
            return queue
        # The talker with the fewest answers being spoken; ties taken in turn.
        self._spoken += 1
        turn = self._spoken % len(speaking)
        index = min(speaking[turn:] + speaking[:turn], key=lambda i: len(self.replicas[i].talker.speech_queues))
        return self.replicas[index].open_speech(request_id, requester)

    async def speak(self, request_id: str, text: str, *, sample_rate: int, final: bool = False,
                    speed: float = 1.0) -> None:
        index = self._speech_owner(request_id)
        if index is not None:
            await self.replicas[index].speak(request_id, text, sample_rate=sample_rate, final=final, speed=speed)

    def cancel_speech(self, request_id: str) -> None:
        unbound = self._unbound_speech.pop(request_id, None)
        if unbound is not None:
            unbound[1].release()
            return
        index = self._speech_owner(request_id)
        if index is not None:
            self.replicas[index].cancel_speech(request_id)
