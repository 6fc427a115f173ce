"""One conformance suite over every eviction policy the registry knows, plus per-policy behaviour."""

from __future__ import annotations

import random
import textwrap

import pytest

from kvmesh.errors import InvalidArgument

from data_plane.eviction import BlockInfo, EvictionPolicy, PolicyRegistry
from data_plane.eviction.arc import ArcPolicy
from data_plane.eviction.cost_aware import CostAwarePolicy
from data_plane.eviction.lru import LruPolicy

POLICIES = PolicyRegistry().names()


@pytest.fixture(params=POLICIES)
def make(request):
    return lambda capacity=8: PolicyRegistry().create(request.param, capacity)


def evict(policy: EvictionPolicy, pinned: frozenset = frozenset()):
    """What the tier does: the first unpinned victim, removed after leaving the iteration."""
    victim = next((k for k in policy.victims() if k not in pinned), None)
    if victim is not None:
        policy.remove(victim, evicted=True)
    return victim


def test_builtins_are_registered():
    assert {"lru", "arc", "cost_aware"} <= set(POLICIES)


def test_tracks_exactly_inserted_minus_removed(make):
    p = make()
    for k in range(5):
        p.insert(k, BlockInfo())
    p.remove(2, evicted=False)
    assert len(p) == 4 and 2 not in p and all(k in p for k in (0, 1, 3, 4))
    assert sorted(p.victims()) == [0, 1, 3, 4]


def test_empty_policy_has_no_victims(make):
    assert list(make().victims()) == []


def test_victims_skip_pinned(make):
    p = make()
    for k in range(4):
        p.insert(k, BlockInfo())
    first = next(iter(p.victims()))
    assert evict(p, pinned=frozenset({first})) not in (first, None)


def test_recently_hit_block_is_not_the_first_victim(make):
    p = make(capacity=16)
    for k in range(8):
        p.insert(k, BlockInfo())
    p.touch(0)
    p.touch(0)
    assert next(iter(p.victims())) != 0


def test_reinsert_after_eviction(make):
    p = make(capacity=4)
    for k in range(4):
        p.insert(k, BlockInfo())
    victim = evict(p)
    p.insert(victim, BlockInfo())
    assert victim in p and len(p) == 4


def test_random_churn_keeps_invariants(make):
    rng = random.Random(7)
    capacity = 16
    p = make(capacity=capacity)
    resident: set[int] = set()
    for _ in range(3000):
        key = rng.randrange(64)
        if key in resident:
            if rng.random() < 0.1:
                p.remove(key, evicted=False)
                resident.discard(key)
            else:
                p.touch(key)
            continue
        if len(resident) == capacity:
            pinned = frozenset(rng.sample(sorted(resident), 3))
            victim = evict(p, pinned)
            assert victim in resident and victim not in pinned
            resident.discard(victim)
        p.insert(key, BlockInfo(cost=rng.random() * 4, protected=rng.random() < 0.05))
        resident.add(key)
        assert len(p) == len(resident)
    victims = list(p.victims())
    assert sorted(victims) == sorted(resident)


def test_lru_order():
    p = LruPolicy(4)
    for k in "abc":
        p.insert(k, BlockInfo())
    p.touch("a")
    assert list(p.victims()) == ["b", "c", "a"]


def test_arc_resists_a_scan():
    """Blocks hit twice (T2) survive a one-pass scan that would flush an LRU."""
    p = ArcPolicy(8)
    hot = [f"hot{i}" for i in range(4)]
    for k in hot:
        p.insert(k, BlockInfo())
        p.touch(k)
    for i in range(32):
        if len(p) == 8:
            evict(p)
        p.insert(f"scan{i}", BlockInfo())
    assert all(k in p for k in hot)


def test_cost_aware_keeps_expensive_and_protected_blocks():
    p = CostAwarePolicy(8)
    p.insert("system-prompt", BlockInfo(cost=1.0, protected=True))
    p.insert("deep", BlockInfo(cost=5.0))
    p.insert("shallow", BlockInfo(cost=1.0))
    assert evict(p) == "shallow"
    assert evict(p) == "deep"
    assert evict(p) == "system-prompt"  # protected blocks go last, not never


def test_cost_aware_ages_blocks_that_stop_being_hit():
    p = CostAwarePolicy(8)
    p.insert("old", BlockInfo(cost=2.0))
    p.insert("x", BlockInfo(cost=1.0))
    assert evict(p) == "x"  # L rises to 1
    p.insert("new", BlockInfo(cost=1.5))  # priority 2.5 > old's 2.0
    assert evict(p) == "old"


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="unknown eviction policy 'nope'.*lru"):
        PolicyRegistry().create("nope", 4)


def test_registering_twice_and_non_policies_are_refused():
    reg = PolicyRegistry()
    with pytest.raises(InvalidArgument, match="already registered"):
        reg.register("lru", LruPolicy)
    reg.register("broken", lambda capacity: object())
    with pytest.raises(InvalidArgument, match="not an EvictionPolicy"):
        reg.create("broken", 4)


def test_external_package_adds_a_policy_by_entry_point(tmp_path, monkeypatch):
    """An installed distribution declaring a `kvmesh.eviction_policies` entry point, no kvmesh changes."""
    (tmp_path / "fifo_plugin.py").write_text(textwrap.dedent("""
        from data_plane.eviction.lru import LruPolicy

        class FifoPolicy(LruPolicy):
            def touch(self, key):
                pass
    """))
    dist = tmp_path / "fifo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fifo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvmesh.eviction_policies]\nfifo = fifo_plugin:FifoPolicy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = PolicyRegistry()
    assert "fifo" in reg.names()
    p = reg.create("fifo", 4)
    for k in "abc":
        p.insert(k, BlockInfo())
    p.touch("a")
    assert list(p.victims()) == ["a", "b", "c"]


def test_batches_leave_the_order_one_call_per_key_leaves(make):
    """insert_all / touch_all / remove_all (a pull's run) end in the same victim order as one call per key. Control:
    the order does depend on the touches (touching changes the first victim)."""
    one, batched = make(capacity=64), make(capacity=64)
    keys = list(range(40))
    infos = [BlockInfo(cost=1.0 + k % 7) for k in keys]
    for k, info in zip(keys, infos):
        one.insert(k, info)
    batched.insert_all(keys, infos)
    touched, removed = keys[5:25:3], keys[30:35]
    for k in touched:
        one.touch(k)
    batched.touch_all(touched)
    for k in removed:
        one.remove(k, evicted=True)
    batched.remove_all(removed, evicted=True)
    assert list(one.victims()) == list(batched.victims())
    untouched = make(capacity=64)
    untouched.insert_all(keys, infos)
    untouched.remove_all(removed, evicted=True)
    assert list(untouched.victims()) != list(batched.victims())
