"""Choosing a replica for a new request, by load and by the prefixes each replica has seen (issue 39:
one Router per pool of replicas, the targets' and the drafts' alike). A request stays on the replica
it was routed to while that replica lives; the router only places new requests.

Prefix affinity, as SGLang's cache-aware router and Ray Serve's PrefixCacheAffinityRouter do it from
the routed text: the router remembers, per replica, the prompts it sent there, as a chain of hashes
over ROUTE_BLOCK-token blocks salted by the request's cache salt (the prefix keys the services' prefix
caches use too, proto/contract.py, with their own block size), plus one key for the whole head
(every prompt token but the last, which is what a service's prefix cache keeps of a prompt). The
longest run of a prompt's leading keys a replica remembers is how much of it that replica's prefix
cache likely holds. Approximate: the replica may have evicted it since, or hold what the router
forgot (after a restart). Each replica's memory is bounded (least recently routed blocks go first).

Load: the requests the router placed on a replica that have not ended (`done`).

The choice, in order:
1. Imbalanced (the most loaded replica has more than IMBALANCE_ABS requests above the least, and more
   than IMBALANCE_REL times as many): the least loaded, whatever it holds.
2. The replica remembering the longest prefix (the less loaded among equals), if that covers
   AFFINITY_SHARE of the prompt's head or more.
3. The least loaded; among equals the one remembering the fewest blocks (the most room), then in turn.
Every decision is counted by its reason (`decisions`: affinity, load, imbalance).

`round-robin` instead (ROUTINGS): each replica in turn, whatever it holds or carries; the baseline
that prefix routing is measured against (scripts/measure_sim_routing.sh).
"""

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from specd.proto.contract import block_hashes, tail_hash

ROUTE_BLOCK = 16  # tokens per remembered block: finer than the services' 64, so short prompts match too
# requests: a difference up to this is never imbalance. SGLang's router uses 64 for GPUs batching
# hundreds; 4 here sent 53 of 130 requests of a 32-context workload at 32 streams over 4 simulated
# replicas away from their prefix (hit rate 43 %), 16 and 64 hit 64 % and 69 % (2026-12-07).
IMBALANCE_ABS = 32
IMBALANCE_REL = 1.5  # ... nor a most loaded replica within 1.5 times the least loaded
AFFINITY_SHARE = 0.3  # of the prompt's head: less than this in common is no reason to prefer a replica
MEMORY_BLOCKS = 1 << 16  # blocks remembered per replica (a million tokens' worth)
ROUTINGS = ("prefix", "round-robin")  # --routing: prefix affinity inside a load bound (the default), or in turn


@dataclass
class Replica:
    name: str
    load: int = 0  # requests placed here and not yet done
    blocks: OrderedDict = field(default_factory=OrderedDict)  # key -> None, least recently routed first
    draining: bool = False  # removed: no new request comes; forgotten when its load is done
    down: bool = False  # failed: no new request comes until it serves again (migration.py)


@dataclass(frozen=True)
class Route:
    replica: str
    reason: str  # affinity, load, imbalance (or round-robin)
    matched_tokens: int  # of the prompt's head, the leading tokens the replica was sent before


class Router:
    def __init__(self, names: list[str], memory_blocks: int = MEMORY_BLOCKS, routing: str = ROUTINGS[0]):
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r}: choose {' or '.join(ROUTINGS)}")
        self.routing = routing
        self.memory_blocks = memory_blocks
        self.replicas: dict[str, Replica] = {}
        self.decisions: Counter[str] = Counter()
        self.turn = 0  # round robin among equals
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        """A replica joins (empty: nothing routed there yet); one draining takes new requests again."""
        self.replicas.setdefault(name, Replica(name)).draining = False

    def remove(self, name: str) -> None:
        """A replica leaves (drained, or dead): no new request goes there, and it is forgotten once the
        requests on it are done (`drained`)."""
        if (replica := self.replicas.get(name)) is not None:
            replica.draining = True
            self._forget_if_drained(replica)

    def drained(self, name: str) -> bool:
        """Whether `name` is out of the pool with no request left on it."""
        return name not in self.replicas

    def serving(self) -> list[Replica]:
        """The replicas that take new requests."""
        return [replica for replica in self.replicas.values() if not (replica.draining or replica.down)]

    def failed(self, name: str) -> None:
        """A replica failed a request: no new request goes there until `back`."""
        if (replica := self.replicas.get(name)) is not None:
            replica.down = True

    def back(self, name: str) -> None:
        """A failed replica serves again: it rejoins empty (a restart lost its prefix cache)."""
        if (replica := self.replicas.get(name)) is not None and replica.down:
            replica.down = False
            replica.blocks.clear()

    def route(self, tokens: list[int], salt: str = "") -> Route:
        """The replica for a new request with these prompt tokens; counts it there until `done`."""
        replicas = self.serving()
        if not replicas:
            raise LookupError("no replica to route to")
        keys = prefix_keys(tokens, salt)
        head = keys[-1][1] if keys else 0
        loads = [replica.load for replica in replicas]
        matched = {replica.name: _matched(replica, keys) for replica in replicas}
        low, high = min(loads), max(loads)
        if self.routing == "round-robin":
            self.turn += 1
            chosen, reason = replicas[self.turn % len(replicas)], "round-robin"
        elif high - low > IMBALANCE_ABS and high > IMBALANCE_REL * low:
            chosen, reason = self._least_loaded(replicas), "imbalance"
        else:
            best = max(replicas, key=lambda replica: (matched[replica.name], -replica.load))
            if head and matched[best.name] >= AFFINITY_SHARE * head:
                chosen, reason = best, "affinity"
            else:
                chosen, reason = self._least_loaded(replicas), "load"
        self._remember(chosen, keys)
        chosen.load += 1
        self.decisions[reason] += 1
        return Route(chosen.name, reason, matched[chosen.name])

    def placed(self, name: str) -> None:
        """A running request moved to `name` (its replica failed): counted there until `done`."""
        if (replica := self.replicas.get(name)) is not None:
            replica.load += 1

    def done(self, name: str) -> None:
        """A request placed on `name` ended (however it ended)."""
        if (replica := self.replicas.get(name)) is not None and replica.load > 0:
            replica.load -= 1
            self._forget_if_drained(replica)

    def _forget_if_drained(self, replica: Replica) -> None:
        if replica.draining and replica.load == 0:
            del self.replicas[replica.name]

    def _least_loaded(self, replicas: list[Replica]) -> Replica:
        self.turn += 1
        count = len(replicas)
        ordered = [replicas[(self.turn + i) % count] for i in range(count)]
        return min(ordered, key=lambda replica: (replica.load, len(replica.blocks)))

    def _remember(self, replica: Replica, keys: list[tuple[bytes, int]]) -> None:
        """The prompt's keys, its first block last: the memory forgets the deepest keys of the least
        recently routed prompts first, as a radix tree evicts leaves, never a block whose longer
        prefixes it keeps (a match runs from the first block)."""
        for key, _ in reversed(keys):
            replica.blocks[key] = None
            replica.blocks.move_to_end(key)
        while len(replica.blocks) > self.memory_blocks:
            replica.blocks.popitem(last=False)


def prefix_keys(tokens: list[int], salt: str = "") -> list[tuple[bytes, int]]:
    """(key, tokens it covers) for each whole ROUTE_BLOCK of the prompt's head (all tokens but the
    last), each key chained on the one before (proto/contract.py's prefix keys), and one more for the
    whole head where it ends inside a block."""
    head = tokens[:-1]
    blocks = len(head) // ROUTE_BLOCK
    chain = block_hashes(salt, head, blocks, ROUTE_BLOCK)
    keys = [(key, (index + 1) * ROUTE_BLOCK) for index, key in enumerate(chain)]
    if len(head) % ROUTE_BLOCK:
        keys.append((tail_hash(salt, chain, head[blocks * ROUTE_BLOCK :]), len(head)))
    return keys


def _matched(replica: Replica, keys: list[tuple[bytes, int]]) -> int:
    """The leading tokens of the head whose keys the replica remembers, in a row from the first."""
    matched = 0
    for key, covered in keys:
        if key not in replica.blocks:
            break
        matched = covered
    return matched
