"""docs/configuration.md lists every setting of every service (kept in sync by this test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from control_plane.config import ControlPlaneConfig
from data_plane.config import DataPlaneConfig

DOC = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()


@pytest.mark.parametrize("settings", [ControlPlaneConfig, DataPlaneConfig])
def test_every_setting_is_documented(settings):
    prefix = settings.model_config["env_prefix"]
    assert prefix in DOC
    missing = [name for name in settings.model_fields if f"| `{name}` |" not in DOC]
    assert not missing, f"{settings.__name__} fields missing from docs/configuration.md: {missing}"
