"""Tenant epochs on a data plane: which of a tenant's blocks this node may still serve.

A tenant id can be deleted and created again; each creation gets a fresh epoch
(tenancy). Block keys here (namespace fingerprint + hash) do not carry it, so
every block is tagged with the epoch this node knew for its tenant when the
block was stored, and a block is served only under that same epoch:

* local callers (the engine's Acquire, a local Lookup, this node's pulls) get
  blocks tagged with the node's current epoch of the tenant (:meth:`current`);
* peers get blocks tagged with the epoch their grant carries (signed by the
  control plane when it issued the grant: immediate, whatever this node knows).

The node learns epochs from the control plane's tenant-limits answer (fetched on
Reserve and pulls, and refreshed for every tenant it holds blocks of once per
refresh period). An epoch it has never been told is ``""`` (no control plane,
or none answered yet): blocks stored then are tagged ``""`` and dropped once a
real epoch is learned (conservative: a cache loss, never an old block served
under a new epoch). The epoch of a tenant deleted, or whose policy no longer
allows this node, is :data:`GONE` (the control plane answers both NOT_FOUND
alike): nothing is served and its blocks go.
When an epoch changes, the node drops the tenant's blocks of other epochs.

Threading model: event-loop thread only.
"""

from __future__ import annotations

from typing import Final

GONE: Final = None  # the tenant does not exist or does not allow this node (the control plane answered NOT_FOUND)
Epoch = str | None  # an epoch, "" when not known, GONE when the tenant was deleted or no longer allows this node


class TenantEpochs:
    def __init__(self) -> None:
        self._known: dict[str, Epoch] = {}

    def current(self, tenant: str) -> Epoch:
        """The tenant's epoch as this node knows it ("" when it was never told)."""
        return self._known.get(tenant, "")

    def learn(self, tenant: str, epoch: Epoch) -> bool:
        """Records the control plane's answer; True when it differs from what was known (blocks tagged
        otherwise must go)."""
        changed = self.current(tenant) != epoch
        self._known[tenant] = epoch
        return changed

    @staticmethod
    def serves(tag: str, wanted: Epoch) -> bool:
        """May a block tagged ``tag`` be served to a caller under ``wanted``? Never under GONE."""
        return wanted is not GONE and tag == wanted
