"""Benchmark programs: ``kvmesh bench NAME`` (each ends with one JSON object under ``--json``)."""
