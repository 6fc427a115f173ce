"""Scheduling: which engine runs a prompt, and whether it pulls the prefix from a peer.

Reading order: ``types`` (requests, decisions, reports), ``config`` (the
``route_*`` settings), ``cost_model`` (measured figures -> milliseconds),
``stats`` (where reported figures live: Redis), ``policies`` (affinity,
load-aware, token-aware, cost-aware), ``speculative`` (routed prefixes held
until the engine's events arrive), ``ledger`` (pulls routed on each NIC),
``router`` (the one entry point the control-plane core calls), ``wire``
(proto <-> these types).
The decision formula is documented in docs/scheduling.md.
"""
