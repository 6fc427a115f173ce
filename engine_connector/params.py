"""Per-request ``kv_transfer_params``: parsed once into :class:`TransferParams`.

The keys follow vLLM's P2P tier (seed 000's table):

| key | this engine is | effect |
|---|---|---|
| ``remote_kv_source`` | P2P consumer | pull the prefix from that peer's data plane, then load it |
| ``remote_prefiller`` | P/D consumer | the same mechanics, from the prefiller's node |
| ``remote_decoder`` | producer | save every full block (no offload cap) and answer, in the output's ``kv_transfer_params``, a ``remote_kv_source`` naming this node for the decoder |
| none | local peer | load from this node's CPU tier (and, with ``auto_source``, from the peer the control plane names) |
| ``remote_decoder`` + ``remote_kv_source`` | both | fetch a prefix, compute the rest, keep it all for the decoder |

``remote_prefiller`` + ``remote_kv_source`` is contradictory (two sources for one block
sequence) and rejected. A source is ``{"kv_request_id", "remote_host", "remote_port"}`` plus
optionally ``"remote_node_id"`` and ``"route_token"`` (what ``ControlPlane.Route`` returns; otherwise
the node is resolved through the control plane; a data plane run with ``require_route_token`` pulls
only from a source whose route token Route signed, and any data plane only from a node's registered
address). ``kv_load_tiers`` restricts where blocks may come from
(``"cpu:local,disk:local,cpu:peer"``, or a list); kvmesh's own options live under ``"kvmesh"``:
``load``, ``save`` (default true), ``max_offload_tokens`` (cap of saved tokens),
``protected_blocks`` (leading blocks the cost-aware eviction keeps, e.g. a system prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import InvalidArgument

from data_plane.types import Locality, Medium, TierFilter

# Key of this connector's own options and report in ``kv_transfer_params``.
PARAMS_KEY = "kvmesh"
SOURCE_KEYS = ("remote_kv_source", "remote_prefiller")


class InvalidTransferParams(ValueError):
    """A request's ``kv_transfer_params`` are malformed or contradictory."""


@dataclass(frozen=True, slots=True)
class PeerSource:
    """A peer data plane to pull from."""

    kind: str  # "remote_kv_source" or "remote_prefiller"
    kv_request_id: str
    host: str
    port: int
    node_id: str = ""
    route_token: str = ""  # Route's signature on this source (nodes with require_route_token need it)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, kind: str, value: Any) -> "PeerSource":
        if not isinstance(value, Mapping):
            raise InvalidTransferParams(f"{kind} must be an object with kv_request_id, remote_host, remote_port")
        host, port = value.get("remote_host"), value.get("remote_port")
        if not host or not isinstance(host, str):
            raise InvalidTransferParams(f"{kind}.remote_host must be a non-empty string")
        try:
            port = int(port)
        except (TypeError, ValueError):
            raise InvalidTransferParams(f"{kind}.remote_port must be a port number, got {port!r}") from None
        if not 0 < port < 65536:
            raise InvalidTransferParams(f"{kind}.remote_port {port} is out of range")
        return cls(kind, str(value.get("kv_request_id", "")), host, port, str(value.get("remote_node_id", "")),
                   str(value.get("route_token", "")))


@dataclass(frozen=True, slots=True)
class TransferParams:
    load: bool = True
    save: bool = True
    source: PeerSource | None = None
    decoder: Mapping[str, Any] | None = None  # remote_decoder as given
    tiers: TierFilter = TierFilter.everything()
    max_offload_tokens: int = 0  # 0: the connector's default
    protected_blocks: int = 0

    @property
    def local_media(self) -> frozenset[Medium]:
        return self.tiers.media(Locality.LOCAL)

    @property
    def peer_media(self) -> frozenset[Medium]:
        return self.tiers.media(Locality.PEER)

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> "TransferParams":
        """Parse ``request.kv_transfer_params``; unknown keys are left to other connectors.

        Raises :class:`InvalidTransferParams` (front ends may call this to reject a request
        before submitting it; the connector catches it and runs the request without transfers).
        """
        params = params or {}
        if not isinstance(params, Mapping):
            raise InvalidTransferParams("kv_transfer_params must be an object")
        given = [key for key in SOURCE_KEYS if params.get(key)]
        if len(given) > 1:
            raise InvalidTransferParams(
                "remote_prefiller and remote_kv_source are contradictory: two sources would compete over one "
                "block sequence; name one")
        source = PeerSource.parse(given[0], params[given[0]]) if given else None
        decoder = params.get("remote_decoder") or None
        if decoder is not None and not isinstance(decoder, Mapping):
            raise InvalidTransferParams("remote_decoder must be an object with kv_request_id")
        tiers = TierFilter.everything()
        if params.get("kv_load_tiers") is not None:
            try:
                tiers = TierFilter.parse(params["kv_load_tiers"])
            except InvalidArgument as exc:
                raise InvalidTransferParams(f"kv_load_tiers: {exc}") from None
        ours = params.get(PARAMS_KEY) or {}
        if not isinstance(ours, Mapping):
            raise InvalidTransferParams(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object")
        try:
            max_offload = int(ours.get("max_offload_tokens", 0))
            protected = int(ours.get("protected_blocks", 0))
        except (TypeError, ValueError):
            raise InvalidTransferParams("max_offload_tokens and protected_blocks must be integers") from None
        if max_offload < 0 or protected < 0:
            raise InvalidTransferParams("max_offload_tokens and protected_blocks must not be negative")
        return cls(load=bool(ours.get("load", True)), save=bool(ours.get("save", True)) or decoder is not None,
                   source=source, decoder=decoder, tiers=tiers, max_offload_tokens=max_offload,
                   protected_blocks=protected)


NO_TRANSFER = TransferParams(load=False, save=False)
