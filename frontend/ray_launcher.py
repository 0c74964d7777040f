"""Data-parallel replicas placed by Ray: each worker process runs inside a Ray actor.

Ray does what a cluster runtime does: it places each replica (a placement group of one bundle:
one GPU on a GPU cluster, the decoder's threads in CPUs otherwise) on a node where that is
free, places it again if the node dies, notices when an actor is gone, and ends the actors when the front end
(the driver) exits. ZeroMQ stays the data path: the worker process an actor starts connects to
the front end's tcp sockets with the CurveZMQ keys the actor hands it (engine/link_keys.py).
When a worker is lost, its supervisor starts a new actor for it in the replica's group, within
the replica's restart budget.

A replica's workers share its bundle's node (and GPU): its decoder and encoder (and talker)
talk over ipc paths there. Ray is imported only here, only with `--ray-address`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys

from engine.link_keys import LinkKeys, allow_workers

logger = logging.getLogger("antiphon.frontend")

# The front end's environment a worker started by Ray keeps (a Ray actor's own is the node's):
# Antiphon's settings (its cache folder, its kernel choices) and those of the libraries it runs,
# never a credential (an API key or a hub token has no business on the workers' nodes).
FORWARDED_PREFIXES = ("ANTIPHON_", "TRITON_", "HF_", "TRANSFORMERS_", "OMP_", "MALLOC_")
CREDENTIAL_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
# Placing a replica waits this long for its resources (a GPU, a CPU) before it counts as
# failing to start.
PLACEMENT_TIMEOUT_S = 600.0
# After asking an actor to kill its process, how long before the actor itself is killed.
KILL_GRACE_S = 5.0


def forwarded_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if name.startswith(FORWARDED_PREFIXES) and not any(word in name for word in CREDENTIAL_WORDS)}


class WorkerProcess:
    """The Ray actor: starts one worker process on its node, reports its exit, kills it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def start(self, args: list[str], ipc_dir: str, environment: dict[str, str]) -> int:
        # The replica's worker-to-worker ipc paths live here, on this node: made private, and
        # refused if someone else made it first.
        os.makedirs(ipc_dir, mode=0o700, exist_ok=True)
        status = os.lstat(ipc_dir)
        if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o077:
            raise PermissionError(f"{ipc_dir} is not a private directory of this user")
        child = {**os.environ, **environment}
        if "OMP_NUM_THREADS" not in environment:
            # Ray caps an actor at its CPU share; the worker sets its own threads.
            child.pop("OMP_NUM_THREADS", None)
        self.process = subprocess.Popen([sys.executable, *args], env=child)
        return self.process.pid

    def wait(self) -> int:
        return self.process.wait()

    def kill(self) -> None:
        """SIGKILL: a hung or stopped worker must not live on beside its successor."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()


class ActorProcess:
    """asyncio.subprocess.Process's surface over a WorkerProcess actor (what a supervisor
    expects of a launcher's handle)."""

    def __init__(self, actor, pid: int) -> None:
        self.actor = actor
        self.pid = pid
        self.returncode: int | None = None
        self._exit = asyncio.ensure_future(self._wait())
        self._killer: asyncio.Task | None = None

    async def _wait(self) -> int:
        import ray

        try:
            code = await self.actor.wait.remote()
        except Exception as exc:  # noqa: BLE001 (the actor or its node is gone, however Ray says it)
            logger.error("worker actor lost: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            code = -9
        self.returncode = code
        try:
            ray.kill(self.actor, no_restart=True)  # its process ended: so does the actor
        except Exception:  # noqa: BLE001 (already gone)
            pass
        return code

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def kill(self) -> None:
        if self._killer is None and not self._exit.done():
            self._killer = asyncio.ensure_future(self._kill())

    async def _kill(self) -> None:
        import ray

        try:
            await asyncio.wait_for(self.actor.kill.remote(), KILL_GRACE_S)
            await asyncio.wait_for(asyncio.shield(self._exit), KILL_GRACE_S)
        except Exception:  # noqa: BLE001 (an actor that does not answer is killed with its node's help)
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 (already gone)
                logger.warning("could not kill a worker actor: %s", exc)


class RayCluster:
    """The front end's place in a Ray cluster: joins it, makes the link keys, admits only its
    own workers on its tcp sockets, and gives each replica a launcher."""

    def __init__(self, address: str, context, device: str, cpus_per_replica: int = 1) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        self.keys = LinkKeys.generate()
        # Bound on this node's address only (never 0.0.0.0), on ports the system picks.
        self.host = ray.util.get_node_ip_address()
        self.context = context
        self.authenticator = None
        resources = ray.cluster_resources()
        self.on_gpus = device != "cpu" and resources.get("GPU", 0) >= 1
        # On CPU nodes a replica's bundle is the decoder's threads (--decoder-threads).
        self.cpus_per_replica = cpus_per_replica
        self.nodes = len([node for node in ray.nodes() if node["Alive"]])
        self.actor_class = ray.remote(max_concurrency=4, max_restarts=0)(WorkerProcess)
        logger.info("joined the Ray cluster at %s (%d node(s), %s); front end links on tcp://%s, CurveZMQ",
                    address, self.nodes, ", ".join(f"{value:g} {key}" for key, value in sorted(resources.items())
                                                   if key in ("CPU", "GPU")), self.host)

    def launcher(self, replica: int) -> "RayLauncher":
        return RayLauncher(self, replica)

    def start(self) -> None:
        """Starts the ZAP handler on the running event loop (an asyncio task), before any
        worker connects (the sockets refuse every client until it runs)."""
        self.authenticator = allow_workers(self.context, self.keys)

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None


class RayLauncher:
    """One replica's workers, all in one placement group of one bundle (one GPU, or the
    decoder's threads in CPUs):
    on one node, and on a GPU cluster on one GPU (the decoder takes most of it, the encoder and
    talker a share of the same one, so Ray gives them all the same CUDA_VISIBLE_DEVICES). Ray
    places the bundle where the resource is free, and places it again if its node dies."""

    DECODER_SHARE = 0.8

    def __init__(self, cluster: RayCluster, replica: int) -> None:
        self.cluster = cluster
        self.replica = replica
        self.keys = cluster.keys
        self.group = None

    def front_end_address(self, run_dir, name: str) -> str:
        return f"tcp://{self.cluster.host}:*"

    async def start(self, worker: str, args: list[str]) -> ActorProcess:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = await self._group()
        share = self.DECODER_SHARE if worker == "decoder" else (1 - self.DECODER_SHARE) / 2
        if self.cluster.on_gpus:
            options = {"num_gpus": share, "num_cpus": 0}
        else:
            options = {"num_cpus": share * self.cluster.cpus_per_replica, "num_gpus": 0}
        actor = self.cluster.actor_class.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
            **options).remote()
        ipc_dir = os.path.dirname(_ipc_path(args))
        environment = {**forwarded_environment(), **self.keys.worker_environment()}
        try:
            pid = await asyncio.wait_for(actor.start.remote(args, ipc_dir, environment), PLACEMENT_TIMEOUT_S)
        except BaseException:
            import ray

            ray.kill(actor, no_restart=True)
            raise
        logger.info("replica %d: %s actor started (pid %d)", self.replica, worker, pid)
        return ActorProcess(actor, pid)

    def close(self) -> None:
        """The replica is shut down: its bundle (a GPU, cores) goes back to the cluster."""
        if self.group is not None:
            from ray.util import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception as exc:  # noqa: BLE001 (the cluster may be gone first)
                logger.warning("could not remove replica %d's placement group: %s", self.replica, exc)
            self.group = None

    async def _group(self):
        from ray.util.placement_group import placement_group

        if self.group is None:
            bundle = {"GPU": 1} if self.cluster.on_gpus else {"CPU": self.cluster.cpus_per_replica}
            self.group = placement_group([bundle], strategy="STRICT_PACK")
        try:
            await asyncio.wait_for(self.group.ready(), PLACEMENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"Ray found no free {'GPU' if self.cluster.on_gpus else 'CPU'} for replica "
                               f"{self.replica} within {PLACEMENT_TIMEOUT_S:g} s") from None
        return self.group


def _ipc_path(args: list[str]) -> str:
    """The first ipc path among a worker's socket flags (they share one directory)."""
    for arg in args:
        if arg.startswith("ipc://"):
            return arg[len("ipc://"):]
    raise ValueError("a worker with no ipc socket")
