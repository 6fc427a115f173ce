"""Reading a NIXL agent's metadata before NIXL loads it (data_plane.nixl_metadata), on a real agent's metadata."""

from __future__ import annotations

import os
import struct
import uuid

import numpy as np
import pytest

from kvmesh.errors import InvalidArgument

from data_plane.nixl_metadata import AgentMetadata, agent_name, node_of_agent, read_agent_metadata

pytestmark = [pytest.mark.nixl]

SLOT = 4096


@pytest.fixture(scope="module")
def real():
    """A real agent's metadata (UCX on tcp) and the buffer it registered."""
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from nixl._api import nixl_agent, nixl_agent_config

    name = agent_name("node-x")
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(8 * SLOT, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    yield name, agent.get_agent_metadata(), buf
    agent.deregister_memory(reg)


def test_a_real_agents_metadata_reads_as_its_name_and_memory(real):
    name, metadata, buf = real
    agent = read_agent_metadata(metadata)
    assert agent == AgentMetadata(name, ((buf.ctypes.data, buf.nbytes),))
    assert agent.node_id == "node-x"


def test_every_cut_and_any_trailing_byte_is_refused(real):
    _, metadata, _ = real
    for cut in range(len(metadata)):
        with pytest.raises(InvalidArgument):
            read_agent_metadata(metadata[:cut])
    with pytest.raises(InvalidArgument):
        read_agent_metadata(metadata + b"|")


@pytest.mark.parametrize("tag, replacement", [(b"MemSection", b"MemSectioN"), (b"nixlSDList", b"nixlSDLisT"),
                                              (b"bknd\x03" + bytes(7) + b"UCX", b"bknd\x03" + bytes(7) + b"GDS")])
def test_a_changed_tag_or_backend_is_refused(real, tag, replacement):
    _, metadata, _ = real
    assert tag in metadata
    with pytest.raises(InvalidArgument):
        read_agent_metadata(metadata.replace(tag, replacement))


def test_memory_other_than_dram_is_refused(real):
    _, metadata, _ = real
    at = metadata.index(b"nixlSDList|") + len(b"nixlSDList|")
    vram = metadata[:at] + b"t" + struct.pack("<Q", 4) + struct.pack("<I", 1) + metadata[at + 13:]
    with pytest.raises(InvalidArgument, match="DRAM"):
        read_agent_metadata(vram)


def test_agent_names_belong_to_one_node():
    assert node_of_agent(agent_name("dp2")) == "dp2"
    assert node_of_agent(agent_name("node-b")) == "node-b"
    assert node_of_agent("dp2-1a2b3c4d-0a0b0c0d") == "dp2-1a2b3c4d"
    for name in ("dp2", "dp2-", "-1a2b3c4d", "dp2-1A2B3C4D", "dp2-1a2b3c4", "dp2-1a2b3c4d0"):
        assert node_of_agent(name) == ""


def test_landing_addresses_must_be_whole_slots_of_registered_memory():
    base = 1 << 40
    agent = AgentMetadata(f"n-{uuid.uuid4().hex[:8]}", ((base, 4 * SLOT), (base + 16 * SLOT, 2 * SLOT)))
    assert agent.holds_slots([base, base + 3 * SLOT, base + 16 * SLOT, base + 17 * SLOT], SLOT)
    assert agent.holds_slots([], SLOT)
    for bad in (base - SLOT, base + 1, base + 4 * SLOT, base + 3 * SLOT + 8, base + 18 * SLOT, 0, (1 << 64) - 1):
        assert not agent.holds_slots([base, bad], SLOT), hex(bad)
