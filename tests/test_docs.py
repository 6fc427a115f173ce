"""docs/configuration.md lists every setting of every service in that service's own table, and nothing else there;
every code block of the docs is run by a test or says why not (kept in sync by these tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from control_plane.config import ControlPlaneConfig
from data_plane.config import DataPlaneConfig

DOC = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()


def _section(env_prefix: str) -> str:
    """The section of configuration.md (up to the next heading of any level) whose heading names ``env_prefix``."""
    (section,) = [s for s in re.split(r"^#+ ", DOC, flags=re.M) if s and env_prefix in s.splitlines()[0]]
    return section


@pytest.mark.parametrize("settings", [ControlPlaneConfig, DataPlaneConfig])
def test_every_setting_is_documented_in_its_services_table(settings):
    section = _section(settings.model_config["env_prefix"])
    rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    missing = [name for name in settings.model_fields if name not in rows]
    assert not missing, f"{settings.__name__} fields missing from its table in docs/configuration.md: {missing}"
    foreign = [name for name in rows if name not in settings.model_fields]
    assert not foreign, f"docs/configuration.md lists {foreign} under {settings.__name__}, which has no such field"
    repeated = sorted({name for name in rows if rows.count(name) > 1})
    assert not repeated, f"docs/configuration.md lists {repeated} twice under {settings.__name__}"


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
