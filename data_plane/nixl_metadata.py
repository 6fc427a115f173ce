"""What a NIXL agent's metadata says, read before NIXL is given it: the agent's name and the memory it registered.

A source loads a consumer's metadata to WRITE into it, so it must know whose agent it is and where it may
write before loading it: NIXL 1.5.1 loads the connection part first and the memory part after, and a
metadata blob whose memory part it cannot read leaves the agent's name half-loaded for good (every later
load of that name, the real metadata included, fails with NIXL_ERR_INVALID_PARAM; removing the agent does
not clear it). :func:`read_agent_metadata` therefore accepts only the exact layout ``get_agent_metadata()``
writes, whole, with DRAM sections of the UCX backend only; anything else is refused here, before NIXL sees
it.

Layout (NIXL's ``nixlSerDes``): ``nixlSerDes|`` then entries ``<tag><u64 length><value>|``::

    Agent=<name> Conns=<u64 n> (t=<backend> c=<connection info>) x n  ""=MemSection
    nixlSecElms=<u64 m> (bknd=<backend> nixlDList=nixlSDList t=<u32 memory type> n=<u64 k>
                         (""=<u64 addr><u64 len><u64 device><backend blob>) x k) x m

Agent names are ``<node id>-<incarnation: 8 hex digits>`` (data_plane.transfer): the node an agent belongs to
is read off its name.
"""

from __future__ import annotations

import re
import struct
import uuid
from dataclasses import dataclass

import numpy as np

from kvmesh.errors import InvalidArgument

MAX_METADATA_BYTES = 1 << 20
MAX_CONNECTIONS = 8
MAX_SECTIONS = 8
MAX_DESCRIPTORS = 64
_HEADER = b"nixlSerDes|"
_DRAM = 0
_INCARNATION = re.compile(r"[0-9a-f]{8}")


def agent_name(node_id: str) -> str:
    """A fresh agent name for ``node_id`` (one per process start)."""
    return f"{node_id}-{uuid.uuid4().hex[:8]}"


def node_of_agent(name: str) -> str:
    """The node id an agent name belongs to ("" when the name is not ``<node id>-<8 hex digits>``)."""
    node_id, dash, incarnation = name.rpartition("-")
    return node_id if dash and node_id and _INCARNATION.fullmatch(incarnation) else ""


@dataclass(frozen=True, slots=True)
class AgentMetadata:
    """A peer agent as its metadata describes it."""

    name: str
    regions: tuple[tuple[int, int], ...]  # (address, length) of each memory descriptor it registered

    @property
    def node_id(self) -> str:
        return node_of_agent(self.name)

    def holds_slots(self, addrs: list[int], slot_bytes: int) -> bool:
        """Whether each address starts a whole slot of ``slot_bytes`` (counted from its region's start) that
        lies inside one registered region."""
        a = np.asarray(addrs, dtype=np.uint64)
        inside = np.zeros(len(a), dtype=bool)
        for base, length in self.regions:
            if length < slot_bytes:
                continue
            offset = a - np.uint64(base)  # wraps around (huge) below the region
            inside |= (a >= np.uint64(base)) & (offset <= np.uint64(length - slot_bytes)) & \
                (offset % np.uint64(slot_bytes) == 0)
        return bool(inside.all())


class _Reader:
    def __init__(self, data: bytes, start: int) -> None:
        self._data = data
        self._at = start

    def entry(self, tag: bytes) -> bytes:
        data, at = self._data, self._at
        end = at + len(tag) + 8
        if data[at:at + len(tag)] != tag or end > len(data):
            raise InvalidArgument(f"agent_metadata: expected the {tag.decode() or 'untagged'} entry at byte {at}")
        (length,) = struct.unpack_from("<Q", data, at + len(tag))
        if end + length + 1 > len(data) or data[end + length:end + length + 1] != b"|":
            raise InvalidArgument(f"agent_metadata: the {tag.decode() or 'untagged'} entry at byte {at} is cut "
                                  "or overruns")
        self._at = end + length + 1
        return data[end:end + length]

    def count(self, tag: bytes, limit: int) -> int:
        value = self.entry(tag)
        if len(value) != 8:
            raise InvalidArgument(f"agent_metadata: {tag.decode()} is not a 64-bit count")
        (n,) = struct.unpack("<Q", value)
        if n > limit:
            raise InvalidArgument(f"agent_metadata: {n} {tag.decode()} (at most {limit})")
        return n

    def expect(self, tag: bytes, value: bytes) -> None:
        if self.entry(tag) != value:
            raise InvalidArgument(f"agent_metadata: {tag.decode() or 'the section marker'} is not {value.decode()}")

    def done(self) -> bool:
        return self._at == len(self._data)


def read_agent_metadata(metadata: bytes) -> AgentMetadata:
    """The agent described by ``metadata`` (as ``get_agent_metadata()`` returns it); InvalidArgument for
    anything else: another layout, another backend than UCX, memory other than DRAM, trailing bytes."""
    if len(metadata) > MAX_METADATA_BYTES or not metadata.startswith(_HEADER):
        raise InvalidArgument("agent_metadata is not a NIXL agent's metadata (as get_agent_metadata() returns it)")
    r = _Reader(metadata, len(_HEADER))
    try:
        name = r.entry(b"Agent").decode()
    except UnicodeDecodeError:
        raise InvalidArgument("agent_metadata: the agent name is not text") from None
    conns = r.count(b"Conns", MAX_CONNECTIONS)
    if conns == 0:
        raise InvalidArgument("agent_metadata: no connection info")
    for _ in range(conns):
        r.expect(b"t", b"UCX")
        if not r.entry(b"c"):
            raise InvalidArgument("agent_metadata: empty connection info")
    r.expect(b"", b"MemSection")
    regions: list[tuple[int, int]] = []
    for _ in range(r.count(b"nixlSecElms", MAX_SECTIONS)):
        r.expect(b"bknd", b"UCX")
        r.expect(b"nixlDList", b"nixlSDList")
        if r.entry(b"t") != struct.pack("<I", _DRAM):
            raise InvalidArgument("agent_metadata: only DRAM sections are accepted")
        for _ in range(r.count(b"n", MAX_DESCRIPTORS)):
            desc = r.entry(b"")
            if len(desc) <= 24:
                raise InvalidArgument("agent_metadata: a memory descriptor without its backend key")
            addr, length, _device = struct.unpack_from("<QQQ", desc)
            if length == 0 or addr + length >= 1 << 64:
                raise InvalidArgument("agent_metadata: a memory descriptor of no or impossible extent")
            regions.append((addr, length))
    if not r.done():
        raise InvalidArgument("agent_metadata: trailing bytes after the memory sections")
    if not regions:
        raise InvalidArgument("agent_metadata: the agent registered no memory")
    return AgentMetadata(name, tuple(regions))
