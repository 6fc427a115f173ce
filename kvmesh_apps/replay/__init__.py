"""``kvmesh bench replay``: replays a Mooncake-format trace through real Route calls.

Reading order: ``trace`` (loading, windowing, block hashes), ``profile`` (the
simulated model and fleet), ``sim`` (engines in virtual time, their tiers
published as real events), ``bench`` (the control plane, the variants, the
report), ``plot``.
"""
