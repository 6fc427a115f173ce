"""Where tier changes go: the control plane's event publisher, or nowhere.

:class:`EventSink` is the part of ``control_plane.publisher.EventPublisher``
the data plane calls on every tier change; both calls are non-blocking
enqueues (the publisher numbers, batches, sends and resyncs).
"""

from __future__ import annotations

from typing import Protocol

from kvmesh.namespace import Namespace


class EventSink(Protocol):
    def stored(self, ns: Namespace, block_hashes: list[bytes], medium: int) -> None: ...

    def removed(self, ns: Namespace, block_hashes: list[bytes], medium: int) -> None: ...


class NoEvents:
    """The sink of a node without a control plane."""

    def stored(self, ns: Namespace, block_hashes: list[bytes], medium: int) -> None:
        pass

    def removed(self, ns: Namespace, block_hashes: list[bytes], medium: int) -> None:
        pass
