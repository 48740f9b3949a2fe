"""The replica router (orchestrator/router.py): prefix affinity inside a load bound."""

import pytest

from specd.orchestrator.router import AFFINITY_SHARE, IMBALANCE_ABS, ROUTE_BLOCK, Router, prefix_keys

SYSTEM = list(range(1000, 1000 + 4 * ROUTE_BLOCK))  # a shared 64-token system prompt


def prompt(user: int, system: list[int] = SYSTEM) -> list[int]:
    return system + [user, user + 1, user + 2]


def test_the_keys_cover_whole_blocks_of_the_head_then_its_tail_and_depend_on_the_salt():
    tokens = list(range(2 * ROUTE_BLOCK + 6))  # head: 2 blocks and 5 tokens; the last token is scored
    keys = prefix_keys(tokens)
    assert [covered for _, covered in keys] == [ROUTE_BLOCK, 2 * ROUTE_BLOCK, 2 * ROUTE_BLOCK + 5]
    assert prefix_keys(tokens + [7])[:2] == keys[:2]  # a longer prompt shares the whole blocks
    assert prefix_keys(tokens + [7])[2] != keys[2]  # ... not the tail of a different head
    assert {key for key, _ in prefix_keys(tokens, "tenant-a")}.isdisjoint(key for key, _ in keys)
    assert prefix_keys([5]) == []  # no head: nothing to remember


def test_requests_sharing_a_prefix_go_where_it_was_sent_and_others_spread_by_load():
    router = Router(["r0", "r1", "r2", "r3"])
    first = router.route(prompt(1))
    assert first.reason == "load" and first.matched_tokens == 0
    again = router.route(prompt(2))  # same system prompt, other user message
    assert (again.replica, again.reason, again.matched_tokens) == (first.replica, "affinity", len(SYSTEM))
    spread = {router.route(prompt(i, [t + 5000 * (i + 1) for t in SYSTEM])).replica for i in range(3)}
    assert first.replica not in spread and len(spread) == 3  # no shared prefix: the least loaded, in turn
    assert router.decisions == {"load": 4, "affinity": 1}


def test_too_little_in_common_is_no_reason_and_the_salt_keeps_tenants_apart():
    router = Router(["r0", "r1"])
    home = router.route(prompt(1)).replica
    short_share = SYSTEM[:ROUTE_BLOCK] + list(range(9000, 9000 + 4 * ROUTE_BLOCK))  # 16 of 80 tokens
    assert ROUTE_BLOCK < AFFINITY_SHARE * (len(short_share) - 1)
    assert router.route(short_share).reason == "load"
    salted = router.route(prompt(2), salt="tenant-b")
    assert salted.reason == "load" and salted.matched_tokens == 0
    assert router.route(prompt(3)).replica == home


def test_an_imbalanced_pool_sends_to_the_least_loaded_whatever_it_holds():
    router = Router(["r0", "r1"])
    home = router.route(prompt(0)).replica
    for user in range(1, IMBALANCE_ABS + 1):  # affinity piles them on one replica, up to the bound
        assert router.route(prompt(user)).replica == home
    escape = router.route(prompt(99))
    assert escape.replica != home and escape.reason == "imbalance"
    for _ in range(IMBALANCE_ABS + 1):
        router.done(home)
    assert router.route(prompt(100)).replica == home  # the load gone, affinity again


def test_replicas_join_and_leave_and_memory_is_bounded():
    router = Router(["r0"], memory_blocks=4)
    router.route(prompt(1))
    assert len(router.replicas["r0"].blocks) == 4  # 5 keys (4 blocks and the tail): the deepest dropped
    assert router.route(prompt(2)).matched_tokens == len(SYSTEM)  # the blocks it kept still match
    router.add("r1")
    assert router.route(list(range(200, 300))).replica == "r1"  # nothing in common: the less loaded
    router.remove("r0")
    assert {router.route(prompt(i)).replica for i in range(3)} == {"r1"}
    router.remove("r1")
    with pytest.raises(LookupError, match="no replica"):
        router.route(prompt(1))


def test_round_robin_takes_each_replica_in_turn_whatever_it_was_sent():
    router = Router(["r0", "r1", "r2"], routing="round-robin")
    routes = [router.route(prompt(i)) for i in range(6)]  # one system prompt: prefix routing keeps it on one
    assert [route.replica for route in routes] == ["r1", "r2", "r0"] * 2
    assert router.decisions == {"round-robin": 6}
    assert routes[3].matched_tokens == len(SYSTEM)  # it was sent there before, and no matter
    with pytest.raises(ValueError, match="round-robin"):
        Router(["r0"], routing="random")


def test_a_removed_replica_takes_no_new_request_and_is_forgotten_once_its_requests_end():
    router = Router(["r0", "r1"])
    home = router.route(prompt(1)).replica
    router.route(prompt(2))  # affinity: the same replica, 2 requests on it
    other = ({"r0", "r1"} - {home}).pop()
    router.remove(home)
    assert [router.route(prompt(i)).replica for i in range(3, 6)] == [other] * 3  # its prefix no matter
    assert router.replicas[home].draining and router.replicas[home].load == 2 and not router.drained(home)
    router.done(home)
    assert not router.drained(home)
    router.done(home)
    assert router.drained(home) and [replica.name for replica in router.serving()] == [other]
    router.add(home)  # back, empty
    assert router.route(list(range(500, 600))).replica == home
