"""NodeLink's calls from the engine's scheduler thread never wait on the network where the connector does not
need the answer at once."""

from __future__ import annotations

import socket
import time

from engine_connector.node_link import NodeLink


def test_address_of_never_waits_on_a_control_plane_that_does_not_answer():
    """Found in review: address_of (called for each finished request a decoder will pull) made a blocking
    ListNodes on the engine's scheduler thread while its node was not yet known, so a frozen control plane stalled
    every running request's step by rpc_timeout_s (5 s) per finished request. Now it answers from what was last
    listed and lists again in the background. The frozen control plane: a listener the kernel accepts on and
    nothing answers. Control: tests/security/test_tls_planes.py (a real control plane: the address is learnt)."""
    frozen = socket.create_server(("127.0.0.1", 0))
    link = NodeLink("127.0.0.1:1", "a-node-key", f"127.0.0.1:{frozen.getsockname()[1]}", rpc_timeout_s=5.0)
    try:
        for _ in range(3):
            started = time.monotonic()
            assert link.address_of("dp1") == ""
            assert time.monotonic() - started < 0.5, "address_of waited on the control plane"
    finally:
        link.close()
        frozen.close()
