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


# Docs that run: every shell or Python block of README.md and docs/ is run by a named test or says why not
# (tests/doc_blocks.py has the marker syntax).

from tests.doc_blocks import all_blocks, blocks, marker_problems  # noqa: E402


def test_every_fence_names_its_language():
    untagged = [b.where for b in all_blocks() if not b.language]
    assert not untagged, f"fences without a language (use text for diagrams and output): {untagged}"


def test_every_code_block_is_run_by_a_test_or_says_why_not():
    problems = marker_problems(all_blocks())
    assert not problems, "\n".join(problems)


def test_the_marker_check_catches_unmarked_and_unrun_blocks(tmp_path):
    """Negative control: an unmarked bash block, and a block whose named runner never uses it."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```bash\nkvmesh up\n```\n\n<!-- doc-block: never-used-block run-by tests/test_hashing.py -->\n"
                    "```python\nprint(1)\n```\n\n<!-- doc-block: illustrative: an example -->\n```bash\nls\n```\n")
    problems = marker_problems(blocks(page))
    assert len(problems) == 2 and "no <!-- doc-block" in problems[0] and "never names" in problems[1]
