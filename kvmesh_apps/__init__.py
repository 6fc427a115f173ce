"""The programs that compose kvmesh's services: the CLI, ``kvmesh up``, the demo, benchmarks and the replay.

This is the top floor: it imports the services (``control_plane``, ``data_plane``,
``engine_connector``, ``tenancy``) and the shared plumbing (``kvmesh``); nothing imports it.
"""
