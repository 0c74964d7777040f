"""Which data-parallel replica serves a request: the one holding the longest cached prefix of
it, among the replicas whose load is within a band of the idlest.

The router's view of each replica is built from what the replicas publish (the blocks their
prefix cache indexes and evicts, with every step's outputs; the items their encoder cache
adds and drops) and from what this front end sent them (requests in flight). It does no I/O
and loads no model: benchmarks/scale_out.py drives this same class with recorded traces.

The rule, for a request whose full prompt blocks hash to H (engine/block_hash.py, the hashes
the decoders index) and whose items are M:

1. Candidates: the healthy replicas. A replica's load is the larger of the requests this front
   end has in flight there and the running + waiting requests it last reported (other front
   ends' requests included).
2. Eligible: candidates with load <= max(min_load * BALANCE_RATIO, min_load + BALANCE_SLACK).
   A replica past the band takes no work for its cache's sake (SGLang's router falls back to
   the shortest queue on the same kind of test).
3. A conversation pinned to an eligible replica stays there (a Realtime session's later turns
   find their prefix even before the first turn's blocks are published).
4. Else the eligible replica holding the longest run of H's leading blocks, if at least
   `min_match_blocks`; ties go to the one whose encoder holds most of M, then to the least load.
5. Else (nothing of it cached anywhere): consistent placement by H[0] (or the first item's
   mm_hash): the first eligible replica of a probe sequence drawn from that key, the same on
   every front end, so that requests sharing a system prompt land together before any event
   about it arrives; a prompt with neither goes to the least loaded.

Cost: one dict lookup and an integer AND per block hash (replica sets are bit masks), plus one
pass over the replicas' loads per request (C-speed list operations); measured by
benchmarks/router_simulation.py at 8 to 256 replicas.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

POLICIES = ("cache-aware", "least-loaded", "round-robin")
BALANCE_RATIO = 1.5
BALANCE_SLACK = 8
_MASK64 = (1 << 64) - 1


class NoReplica(Exception):
    """Every replica is down."""


def _mix(value: int) -> int:
    """splitmix64's finalizer: the same on every front end (Python's hash() is salted)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class ReplicaRouter:
    def __init__(self, num_replicas: int, policy: str = "cache-aware", *, balance_ratio: float = BALANCE_RATIO,
                 balance_slack: int = BALANCE_SLACK, min_match_blocks: int = 1, max_pins: int = 100_000) -> None:
        if num_replicas < 1:
            raise ValueError("a router needs at least one replica")
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}")
        self.num_replicas = num_replicas
        self.policy = policy
        self.balance_ratio = balance_ratio
        self.balance_slack = balance_slack
        self.min_match_blocks = min_match_blocks
        self.max_pins = max_pins
        self.healthy = [True] * num_replicas
        self._healthy_mask = (1 << num_replicas) - 1
        self.in_flight = [0] * num_replicas
        self.reported_load = [0] * num_replicas
        # Block hash -> bit mask of the replicas whose prefix cache indexes it; and the reverse,
        # so a replica that goes down is forgotten in time proportional to what it held.
        self._block_holders: dict[bytes, int] = {}
        self._blocks_held: list[set[bytes]] = [set() for _ in range(num_replicas)]
        self._item_holders: dict[str, int] = {}
        self._items_held: list[set[str]] = [set() for _ in range(num_replicas)]
        # Conversation -> (replica, its generation then): a replica that went down and came
        # back is a new generation with empty caches, and its old pins no longer hold.
        self._pins: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._generation = [0] * num_replicas
        self._next_round_robin = 0
        # Per replica: requests routed there, and of those how many for a cached prefix.
        self.routed = [0] * num_replicas
        self.routed_for_prefix = [0] * num_replicas

    # ---- routing ----------------------------------------------------------------------

    def route(self, block_hashes: Iterable[bytes], mm_hashes: Sequence[str] = (),
              conversation: str | None = None) -> int:
        """The replica for a request (counted in flight there until `finished`)."""
        replica, for_prefix = self._choose(block_hashes, mm_hashes, conversation)
        self.in_flight[replica] += 1
        self.routed[replica] += 1
        self.routed_for_prefix[replica] += for_prefix
        if conversation is not None:
            self._pins[conversation] = (replica, self._generation[replica])
            self._pins.move_to_end(conversation)
            if len(self._pins) > self.max_pins:
                self._pins.popitem(last=False)
        return replica

    def finished(self, replica: int) -> None:
        if self.in_flight[replica] > 0:
            self.in_flight[replica] -= 1

    def _choose(self, block_hashes: Iterable[bytes], mm_hashes: Sequence[str],
                conversation: str | None) -> tuple[int, bool]:
        if not self._healthy_mask:
            raise NoReplica("every replica is down")
        loads = [max(a, b) for a, b in zip(self.in_flight, self.reported_load)]
        if self.policy == "round-robin":
            while True:
                replica = self._next_round_robin
                self._next_round_robin = (replica + 1) % self.num_replicas
                if self.healthy[replica]:
                    return replica, False
        lightest = min(load for load, up in zip(loads, self.healthy) if up)
        if self.policy == "least-loaded":
            return self._first_with_load(loads, lightest), False
        bound = max(lightest * self.balance_ratio, lightest + self.balance_slack)

        def eligible(replica: int) -> bool:
            return self.healthy[replica] and loads[replica] <= bound

        if conversation is not None:
            pinned, generation = self._pins.get(conversation, (0, -1))
            if generation == self._generation[pinned] and eligible(pinned):
                return pinned, True
        # The deepest run of leading blocks that an eligible replica holds.
        holders_at, first_hash = self._holders_by_depth(block_hashes)
        for depth in range(len(holders_at), max(self.min_match_blocks, 1) - 1, -1):
            best = [replica for replica in _bits(holders_at[depth - 1]) if eligible(replica)]
            if best:
                return min(best, key=lambda r: (-self._items_held_of(r, mm_hashes), loads[r])), True
        key = first_hash if first_hash is not None else (mm_hashes[0].encode() if mm_hashes else None)
        if key is None:
            return self._first_with_load(loads, lightest), False
        return self._placement(int.from_bytes(key[:8], "little"), eligible), False

    def _first_with_load(self, loads: list[int], load: int) -> int:
        return next(r for r, value in enumerate(loads) if value == load and self.healthy[r])

    def _placement(self, seed: int, eligible) -> int:
        """Consistent placement of a cold prompt: the first eligible replica of a probe
        sequence drawn from its key (the same on every front end; a replica that leaves moves
        only the keys that probed it first). Falls back to a scan after many misses."""
        for attempt in range(4 * self.num_replicas.bit_length() + 8):
            replica = _mix(seed + attempt) % self.num_replicas
            if eligible(replica):
                return replica
        return next(replica for replica in range(self.num_replicas) if eligible(replica))

    def _holders_by_depth(self, block_hashes: Iterable[bytes]) -> tuple[list[int], bytes | None]:
        """For each depth d, the healthy replicas holding the first d + 1 blocks (bit masks,
        each a subset of the one before), up to the first block nobody healthy holds; and the
        first block's hash. Reads no hash past that block (they may be made as it reads)."""
        alive = self._healthy_mask
        holders_of = self._block_holders
        masks = []
        first = None
        for block_hash in block_hashes:
            if first is None:
                first = block_hash
            alive &= holders_of.get(block_hash, 0)
            if not alive:
                break
            masks.append(alive)
        return masks, first

    def _items_held_of(self, replica: int, mm_hashes: Sequence[str]) -> int:
        held = self._items_held[replica]
        return sum(1 for mm_hash in mm_hashes if mm_hash in held)

    def item_holders(self, mm_hash: str) -> list[int]:
        return list(_bits(self._item_holders.get(mm_hash, 0)))

    def block_holders(self, block_hash: bytes) -> list[int]:
        return list(_bits(self._block_holders.get(block_hash, 0)))

    # ---- what the replicas publish ------------------------------------------------------

    def prefix_changed(self, replica: int, stored: Iterable[bytes], evicted: Iterable[bytes],
                       cleared: bool = False) -> None:
        if cleared:
            self._forget(replica, self._block_holders, self._blocks_held)
        self._change(replica, stored, evicted, self._block_holders, self._blocks_held)

    def items_changed(self, replica: int, added: Iterable[str], removed: Iterable[str]) -> None:
        self._change(replica, added, removed, self._item_holders, self._items_held)

    @staticmethod
    def _change(replica: int, added, removed, holders: dict, held: list[set]) -> None:
        bit = 1 << replica
        mine = held[replica]
        for key in removed:
            if key in mine:
                mine.discard(key)
                left = holders.get(key, 0) & ~bit
                if left:
                    holders[key] = left
                else:
                    holders.pop(key, None)
        for key in added:
            if key not in mine:
                mine.add(key)
                holders[key] = holders.get(key, 0) | bit

    @classmethod
    def _forget(cls, replica: int, holders: dict, held: list[set]) -> None:
        cls._change(replica, (), list(held[replica]), holders, held)

    def load_reported(self, replica: int, running_and_waiting: int) -> None:
        self.reported_load[replica] = running_and_waiting

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """Whether the replica takes requests now (its caches stay known)."""
        self.healthy[replica] = healthy
        if healthy:
            self._healthy_mask |= 1 << replica
        else:
            self._healthy_mask &= ~(1 << replica)

    def replica_down(self, replica: int) -> None:
        """Lost: nothing more is routed to it, and what it held is forgotten (its successor
        starts with empty caches); its pinned conversations move on their next turn."""
        self.set_healthy(replica, False)
        self._generation[replica] += 1
        self.reported_load[replica] = 0
        self._forget(replica, self._block_holders, self._blocks_held)
        self._forget(replica, self._item_holders, self._items_held)

    def replica_up(self, replica: int) -> None:
        self.set_healthy(replica, True)

    def encoder_down(self, replica: int) -> None:
        """Its encoder was lost: the items it held are gone (the decoder's blocks are not)."""
        self._forget(replica, self._item_holders, self._items_held)

    def blocks_indexed(self, replica: int) -> int:
        return len(self._blocks_held[replica])
