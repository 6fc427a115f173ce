"""``kvmesh bench replay``: a Mooncake-format trace on simulated engines, routed by the control plane's router.

Reading order: ``trace`` (checking, windowing, block hashes; bad input is one
line and exit 2 through ``kvmesh.command_line``), ``costs`` (what an engine step costs: Vidur-measured
operator times), ``profile`` (the fleet), ``engine`` (continuous batching, KV
memory, tiers), ``network`` (NICs and rack uplinks), ``backends`` (the router in
process, or a real control plane), ``sim`` (the replay in virtual time), ``runs``
(one run, summaries, intervals), ``sweep``, ``bench`` (the command), ``plot``.
``kvmesh bench sim-to-real`` (``kvmesh_apps/bench/sim_to_real.py``) checks the
simulator against real engines.
"""
