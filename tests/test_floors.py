"""The floors of docs/architecture.md, checked from the source (AST only, nothing imported): no module imports one
on a higher floor, and a service reaches a lower one only through that service's public modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: an import may go to its own package or to a lower floor.
FLOORS = ("kvmesh", "tenancy", "control_plane", "data_plane", "engine_connector", "kvmesh_apps")
# What a service above may use of a lower one (kvmesh/ is all public; kvmesh_apps may use anything).
PUBLIC = {
    "tenancy": ("tenancy.model", "tenancy.auth", "tenancy.grants", "tenancy.peer_proof", "tenancy.api_keys"),
    "control_plane": ("control_plane.publisher", "control_plane.scheduler_client"),
    "data_plane": ("data_plane.client", "data_plane.types"),
}
# The control plane's process hosts tenancy's admin service, store and authorizer.
HOSTS = {"control_plane": ("tenancy",)}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for floor, package in enumerate(FLOORS):
        for path in sorted((root / package).rglob("*.py")):
            if "v1" in path.relative_to(root).parts:  # generated stubs
                continue
            for target, line in _imports(path):
                top = target.split(".")[0]
                if top not in FLOORS or top == package:
                    continue
                where = f"{path.relative_to(root)}:{line} imports {target}"
                if FLOORS.index(top) > floor:
                    found.append(f"{where} (a higher floor)")
                elif (package != "kvmesh_apps" and top != "kvmesh" and top not in HOSTS.get(package, ())
                      and not any(target == m or target.startswith(m + ".") for m in PUBLIC.get(top, ()))):
                    found.append(f"{where} (not one of {top}'s public modules)")
    return found


def test_no_module_imports_a_higher_floor_or_a_lower_services_insides() -> None:
    assert violations() == []


def test_the_check_catches_an_upward_import_and_a_reach_inside(tmp_path) -> None:
    """Negative control: plumbing importing a program, and a connector importing the data plane's core."""
    for package in FLOORS:
        (tmp_path / package).mkdir()
    (tmp_path / "kvmesh" / "bad.py").write_text("from kvmesh_apps import cli\n")
    (tmp_path / "engine_connector" / "bad.py").write_text("import data_plane.core\nfrom data_plane.client import X\n")
    assert sorted(violations(tmp_path)) == [
        "engine_connector/bad.py:1 imports data_plane.core (not one of data_plane's public modules)",
        "kvmesh/bad.py:1 imports kvmesh_apps.cli (a higher floor)"]
