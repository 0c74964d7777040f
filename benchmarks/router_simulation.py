"""The data-parallel router past one machine: frontend/replica_router.py's own class, driven by
multi-tenant traces at 8, 64 and 256 replicas with simulated replicas instead of models.

    python benchmarks/router_simulation.py            # the table (about a minute)
    python benchmarks/router_simulation.py --quick

The trace has the live benchmark's shape (benchmarks/scale_out.py), scaled with the cluster:
TENANTS_PER_REPLICA tenants per replica, each with its own system prompt; each tenant's users
hold conversations of several turns, each turn's prompt the previous one plus the answer and
a new question. Token ids are drawn per tenant and user, and the block hashes are the engine's
own (engine/block_hash.py), so the router sees what a real front end computes.

A simulated replica has an LRU prefix cache of `kv_blocks` blocks (the engine's eviction order)
and serves prefills one at a time, in order, at `prefill_s_per_token` for each prompt token its
cache misses (prefill is compute-bound: prefills queue); decodes batch beside them and take
`answer_tokens` x `decode_s` without queueing. It publishes the blocks it stores and evicts
right away, as a decoder does after each step. Requests arrive at a fixed rate that loads the
cluster's prefill at `load` of its capacity without any cache hit.

Printed per policy and cluster size: prefix hit rate (prompt tokens served from cache), load
imbalance (busiest replica's prefill time over the mean), time to first token p50 / p99
(queueing + prefill), and the router's CPU time per request and per block (route + the events it
digests, measured with perf_counter around the router's calls alone; the front end's hashing of
the blocks is printed apart).
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.block_hash import prompt_block_hashes  # noqa: E402
from frontend.replica_router import POLICIES, ReplicaRouter  # noqa: E402

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    tenants_per_replica: int = 8
    users_per_tenant: int = 4
    turns: int = 4
    system_tokens: int = 512
    question_tokens: int = 48
    answer_tokens: int = 64
    kv_blocks: int = 1024
    prefill_s_per_token: float = 0.0002
    decode_s: float = 0.01
    load: float = 0.7


QUICK = Shape(tenants_per_replica=4, users_per_tenant=2, turns=3)


@dataclass
class TraceRequest:
    session: int
    block_hashes: list[bytes]
    prompt_tokens: int


def make_trace(replicas: int, shape: Shape, seed: int = 0) -> list[TraceRequest]:
    """Every user's turns in order, the users' sessions interleaved at random."""
    rng = random.Random(seed)
    sessions = []
    for tenant in range(replicas * shape.tenants_per_replica):
        system = [rng.randrange(1, 50_000) for _ in range(shape.system_tokens)]
        for user in range(shape.users_per_tenant):
            tokens = list(system)
            turns = []
            for _ in range(shape.turns):
                tokens += [rng.randrange(1, 50_000) for _ in range(shape.question_tokens)]
                turns.append(list(tokens))
                tokens += [rng.randrange(1, 50_000) for _ in range(shape.answer_tokens)]
            sessions.append(turns)
    order = [index for index, turns in enumerate(sessions) for _ in turns]
    rng.shuffle(order)
    next_turn = [0] * len(sessions)
    trace = []
    for index in order:
        prompt = sessions[index][next_turn[index]]
        next_turn[index] += 1
        trace.append(TraceRequest(index, prompt_block_hashes(prompt, (), None, BLOCK_SIZE), len(prompt)))
    return trace


class SimulatedReplica:
    def __init__(self, kv_blocks: int) -> None:
        self.capacity = kv_blocks
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.free_at = 0.0
        self.busy_s = 0.0

    def serve(self, hashes: list[bytes]) -> tuple[int, list[bytes], list[bytes]]:
        """Runs a prompt through the cache: (hit blocks, blocks stored, blocks evicted)."""
        hits = 0
        for block_hash in hashes:
            if block_hash not in self.cache:
                break
            hits += 1
        for block_hash in hashes[:hits]:
            self.cache.move_to_end(block_hash)
        stored, evicted = hashes[hits:], []
        for block_hash in stored:
            self.cache[block_hash] = None
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        return hits, stored, evicted


def simulate(trace: list[TraceRequest], replicas: int, policy: str, shape: Shape) -> dict:
    router = ReplicaRouter(replicas, policy)
    fleet = [SimulatedReplica(shape.kv_blocks) for _ in range(replicas)]
    mean_cold_s = sum(r.prompt_tokens for r in trace) / len(trace) * shape.prefill_s_per_token
    interval = mean_cold_s / (replicas * shape.load)
    decode_s = shape.answer_tokens * shape.decode_s
    # Requests in service, by the time they end: (end, sequence, replica).
    ending: list[tuple[float, int, int]] = []
    router_s = 0.0
    blocks_routed = 0
    hit_tokens = prompt_tokens = 0
    ttfts = []
    for sequence, request in enumerate(trace):
        now = sequence * interval
        while ending and ending[0][0] <= now:
            _, _, done = heapq.heappop(ending)
            started = time.perf_counter()
            router.finished(done)
            router_s += time.perf_counter() - started
        started = time.perf_counter()
        index = router.route(request.block_hashes, (), f"session-{request.session}")
        router_s += time.perf_counter() - started
        blocks_routed += len(request.block_hashes)
        replica = fleet[index]
        hits, stored, evicted = replica.serve(request.block_hashes)
        started = time.perf_counter()
        router.prefix_changed(index, stored, evicted)
        router_s += time.perf_counter() - started
        prefill_s = (request.prompt_tokens - hits * BLOCK_SIZE) * shape.prefill_s_per_token
        # Prefills queue (compute-bound, one at a time); decodes batch beside them.
        begin = max(now, replica.free_at)
        replica.free_at = begin + prefill_s
        replica.busy_s += prefill_s
        ttfts.append(replica.free_at - now)
        heapq.heappush(ending, (replica.free_at + decode_s, sequence, index))
        hit_tokens += hits * BLOCK_SIZE
        prompt_tokens += request.prompt_tokens
    busy = [replica.busy_s for replica in fleet]
    ttfts.sort()
    return {"hit_rate": hit_tokens / prompt_tokens, "imbalance": max(busy) / (sum(busy) / len(busy)),
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p99_s": ttfts[int(len(ttfts) * 0.99)],
            "prefill_s": sum(busy), "router_us_per_request": router_s / len(trace) * 1e6,
            "router_us_per_block": router_s / blocks_routed * 1e6, "requests": len(trace)}


def hashing_us_per_block(shape: Shape, samples: int = 200) -> float:
    """What the front end spends hashing a prompt's blocks (the router's input), per block."""
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 50_000) for _ in range(shape.system_tokens)] for _ in range(samples)]
    started = time.perf_counter()
    for prompt in prompts:
        prompt_block_hashes(prompt, (), None, BLOCK_SIZE)
    return (time.perf_counter() - started) / (samples * (shape.system_tokens // BLOCK_SIZE)) * 1e6


def run(sizes: tuple[int, ...], shape: Shape) -> list[dict]:
    rows = []
    for replicas in sizes:
        trace = make_trace(replicas, shape)
        for policy in POLICIES:
            rows.append({"replicas": replicas, "policy": policy, **simulate(trace, replicas, policy, shape)})
    return rows


def print_table(rows: list[dict], shape: Shape) -> None:
    print(f"simulated replicas: {shape.kv_blocks} KV blocks of {BLOCK_SIZE} tokens each, "
          f"{shape.tenants_per_replica} tenants per replica x {shape.users_per_tenant} users x {shape.turns} turns, "
          f"system prompt {shape.system_tokens} tokens, load {shape.load:.0%} of the no-cache capacity")
    print(f"{'replicas':>8} {'policy':<13} {'requests':>8} {'prefix hit':>10} {'imbalance':>9} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'prefill work':>12} {'router/req':>10} {'router/block':>12}")
    cache_aware = {row["replicas"]: row for row in rows if row["policy"] == "cache-aware"}
    for row in rows:
        work = row["prefill_s"] / cache_aware[row["replicas"]]["prefill_s"]
        print(f"{row['replicas']:>8} {row['policy']:<13} {row['requests']:>8} {row['hit_rate']:>10.1%} "
              f"{row['imbalance']:>8.2f}x {row['ttft_p50_s'] * 1000:>7.0f}ms {row['ttft_p99_s'] * 1000:>7.0f}ms "
              f"{work:>11.2f}x {row['router_us_per_request']:>8.1f}us {row['router_us_per_block']:>10.2f}us")
    print("prefill work: total prefill time over cache-aware's in the same cluster")
    print(f"front end's block hashing (sha256, the decoders' own): {hashing_us_per_block(shape):.2f} us per block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller trace, to check that the script runs")
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 256])
    args = parser.parse_args()
    shape = QUICK if args.quick else Shape()
    print_table(run(tuple(args.replicas), shape), shape)


if __name__ == "__main__":
    main()
