"""The generated gRPC code under kvmesh/v1 matches proto/ (run `make proto` when this fails)."""

from __future__ import annotations

from kvmesh.protogen import ROOT, generate


def test_generated_code_is_fresh(tmp_path):
    stale = []
    for rel in generate(tmp_path):
        committed = ROOT / rel
        if not committed.exists() or committed.read_bytes() != (tmp_path / rel).read_bytes():
            stale.append(str(rel))
    assert not stale, f"generated code is stale, run `make proto`: {stale}"
