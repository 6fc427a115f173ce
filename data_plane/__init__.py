"""kvmesh data plane: one node's pinned CPU tier, disk tier and NIXL peer pulls.

Reading order: ``types`` (domain types) -> ``shm`` (the shared region) ->
``tier`` (slots and block lifecycle) -> ``eviction`` (policies, registry) ->
``disk`` -> ``leases`` -> ``transfer`` (Transport, NIXL) -> ``peers`` ->
``core`` (every operation) -> ``wire``/``servicer``/``server`` (gRPC edge) ->
``client`` (what the engine connector uses) -> ``bench``. docs/data_plane.md
has the design, lifecycles and failure policy.
"""
