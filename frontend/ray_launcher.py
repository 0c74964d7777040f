"""Data-parallel replicas placed by Ray: each worker process runs inside a Ray actor.

Ray does what a cluster runtime does: it places each actor on a node with the resources asked
(a decoder takes one GPU on a GPU cluster, one CPU otherwise; an encoder or talker shares its
replica's node), notices when an actor or its node is gone, and ends the actors when the front
end (the driver) exits. ZeroMQ stays the data path: the worker process the actor starts connects
to the front end's tcp sockets with the CurveZMQ keys the actor hands it (engine/link_keys.py).
When a worker is lost, its supervisor starts a new actor for it (Ray places it again: on
another node if its own is gone) within the replica's restart budget.

A replica's workers share one node: its decoder and encoder (and talker) talk over ipc paths
there. Ray is imported only here, only with `--data-parallel-size`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

from engine.link_keys import LinkKeys, allow_workers

logger = logging.getLogger("antiphon.frontend")

# The front end's environment a worker started by Ray keeps (a Ray actor's own is the node's):
# Antiphon's settings (its cache folder, its kernel choices), and those of the libraries it runs.
FORWARDED_PREFIXES = ("ANTIPHON_", "TRITON_", "HF_", "TRANSFORMERS_", "OMP_", "MALLOC_")


def forwarded_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_PREFIXES)}


class WorkerProcess:
    """The Ray actor: starts one worker process on its node, reports its exit, kills it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def start(self, args: list[str], ipc_dir: str, environment: dict[str, str]) -> int:
        # The replica's worker-to-worker ipc paths live here, on this node.
        os.makedirs(ipc_dir, mode=0o700, exist_ok=True)
        self.process = subprocess.Popen([sys.executable, *args], env={**os.environ, **environment})
        return self.process.pid

    def wait(self) -> int:
        return self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()


class ActorProcess:
    """asyncio.subprocess.Process's surface over a WorkerProcess actor (what a supervisor
    expects of a launcher's handle)."""

    def __init__(self, actor, pid: int) -> None:
        import ray

        self.actor = actor
        self.pid = pid
        self.returncode: int | None = None
        self._exit = asyncio.ensure_future(self._wait(ray))

    async def _wait(self, ray) -> int:
        try:
            code = await self.actor.wait.remote()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
            # The actor itself is gone (killed, its node lost): so is the process it ran.
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
        import ray

        # The actor's death ends its process (which dies with its parent).
        ray.kill(self.actor, no_restart=True)


class RayCluster:
    """The front end's place in a Ray cluster: joins it, makes the link keys, admits only its
    own workers on its tcp sockets, and gives each replica a launcher."""

    def __init__(self, address: str, context, on_gpus: bool) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        self.keys = LinkKeys.generate()
        # Bound on this node's address only (never 0.0.0.0), on ports the system picks.
        self.host = ray.util.get_node_ip_address()
        self.context = context
        self.authenticator = None
        self.on_gpus = on_gpus
        self.actor_class = ray.remote(max_concurrency=4, max_restarts=0)(WorkerProcess)
        logger.info("joined the Ray cluster at %s (%d node(s), %s); front end links on tcp://%s, CurveZMQ",
                    address, len([node for node in ray.nodes() if node["Alive"]]),
                    ", ".join(f"{value:g} {key}" for key, value in sorted(ray.cluster_resources().items())
                              if key in ("CPU", "GPU")), self.host)

    def launcher(self, replica: int) -> "RayLauncher":
        return RayLauncher(self, replica)

    def start(self) -> None:
        """Starts the ZAP handler on the running event loop (an asyncio task), before any
        worker connects: without a handler libzmq would let in any Curve client."""
        self.authenticator = allow_workers(self.context, self.keys)

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()


class RayLauncher:
    def __init__(self, cluster: RayCluster, replica: int) -> None:
        self.cluster = cluster
        self.replica = replica
        self.keys = cluster.keys
        # The node this replica's workers run on, while it is alive.
        self.node_id: str | None = None

    def front_end_address(self, run_dir, name: str) -> str:
        return f"tcp://{self.cluster.host}:*"

    async def start(self, worker: str, args: list[str]) -> ActorProcess:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options: dict = {"num_cpus": 0, "num_gpus": 0}
        if worker == "decoder":
            options["num_gpus" if self.cluster.on_gpus else "num_cpus"] = 1
        node = self._node()
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        actor = self.cluster.actor_class.options(**options).remote()
        ipc_dir = os.path.dirname(_ipc_path(args))
        environment = {**forwarded_environment(), **self.keys.worker_environment()}
        pid = await actor.start.remote(args, ipc_dir, environment)
        logger.info("replica %d: %s actor started (pid %d on node %s)", self.replica, worker, pid, node[:8])
        return ActorProcess(actor, pid)

    def _node(self) -> str:
        """The replica's node: kept while it is alive; else the live nodes with the decoder's
        resource (a GPU or a CPU), taken in turn by replica index."""
        import ray

        alive = [node for node in ray.nodes() if node["Alive"]]
        if self.node_id is not None and any(node["NodeID"] == self.node_id for node in alive):
            return self.node_id
        resource = "GPU" if self.cluster.on_gpus else "CPU"
        able = sorted(node["NodeID"] for node in alive if node["Resources"].get(resource, 0) >= 1)
        if not able:
            raise RuntimeError(f"no live Ray node has a {resource} for replica {self.replica}'s decoder")
        self.node_id = able[self.replica % len(able)]
        return self.node_id


def _ipc_path(args: list[str]) -> str:
    """The first ipc path among a worker's socket flags (they share one directory)."""
    for arg in args:
        if arg.startswith("ipc://"):
            return arg[len("ipc://"):]
    raise ValueError("a worker with no ipc socket")
