"""docs/configuration.md lists every setting of every service in that service's own table, and nothing else there;
every code block of the docs is run by a test or says why not (kept in sync by these tests)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
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

from tests.doc_blocks import ROOT, all_blocks, blocks, doc_block, marker_problems  # noqa: E402


def test_every_fence_names_its_language():
    untagged = [b.where for b in all_blocks() if not b.language]
    assert not untagged, f"fences without a language (use text for diagrams and output): {untagged}"


def test_every_code_block_is_run_by_a_test_or_says_why_not():
    problems = marker_problems(all_blocks())
    assert not problems, "\n".join(problems)


def test_the_marker_check_catches_unmarked_and_unrun_blocks(tmp_path):
    """Negative control: an unmarked bash block, a block whose named runner never uses it, and an unmarked text block
    with a command in it; a text block of output and a marked one pass."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```bash\nkvmesh up\n```\n\n"
                    "<!-- doc-block: never-used-block run-by tests/test_hashing.py -->\n```python\nprint(1)\n```\n\n"
                    "<!-- doc-block: illustrative: an example -->\n```bash\nls\n```\n\n"
                    "```text\nkvmesh bench replay --trace t.jsonl   # a command in a text block\n```\n\n"
                    "```text\nholders {'dp1': 32}\n```\n\n<!-- doc-block: illustrative: a synopsis -->\n"
                    "```text\n  python -m kvmesh_apps.replay.tables FILE\n```\n")
    problems = marker_problems(blocks(page))
    assert len(problems) == 3, problems
    assert "no <!-- doc-block" in problems[0] and "never names" in problems[1]
    assert "text block (a line of it starts like a command)" in problems[2]


def _venv_env() -> dict[str, str]:
    """The environment of a reader with .venv active: its bin/ (kvmesh, python) first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_replay_quick_start_runs_as_written_on_the_in_repo_trace(tmp_path):
    """docs/scheduling.md's replay-quick-start, typed in a clone's root (here a directory holding the clone's
    tests/data, so replay-out/ lands in tmp_path), with no ../shared beside it: ~6 s."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + doc_block("replay-quick-start")], cwd=tmp_path,
                          env=_venv_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert result["trace"]["windows"] == [0, 200, 400, 600, 800] and result["trace"]["note"] == ""
    assert result["policies"]["cost-aware+p2p"]["goodput_rps_ci95"] is not None
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| variant | goodput") and any(r.startswith("| no-sharing | ") for r in rows), rows
    assert (tmp_path / "replay-out" / "replay.json").is_file()


# README's first command, `make demo`, prints the demo's text report on stdout; CI runs it with --json (the same
# report on stderr) and tests/test_commands.py on the tiny model, both with engines. This renders the same text path
# (the turn table, the summary) through kvmesh_apps.demo's own functions, with engines and the control plane faked by
# a model of what they return, so that a crash in the text report is caught in seconds.

class _FakeTiers:
    """What each node's CPU tier holds: the prompts its engine saved (full blocks)."""

    def __init__(self) -> None:
        self.saved: dict[str, list[list[int]]] = {"dp1": [], "dp2": []}

    def blocks(self, node: str, prompt: list[int]) -> int:
        def common(a: list[int], b: list[int]) -> int:
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return n // 32
        return max((common(prompt, p) for p in self.saved[node]), default=0)


class _FakeRouter:
    def __init__(self, fleet: _FakeTiers) -> None:
        self.tiers = fleet

    def source(self, prompt: list[int], node: str):
        usable = (len(prompt) - 1) // 32
        holders = {n: self.tiers.blocks(n, prompt) for n in ("dp1", "dp2")}
        best = max(holders.items(), key=lambda kv: kv[1])
        held = min(best[1], usable) * 32
        if not best[1] or best[0] == node or best[1] <= holders[node]:
            return None, held, 2.9
        return {"remote_host": "127.0.0.1", "remote_port": 40000, "remote_node_id": best[0]}, held, 2.9

    def wait_indexed(self, prompt: list[int], node: str, blocks: int) -> None:
        pass


class _FakeEngine:
    """An engine as the demo sees it: a completion with the connector's report, ~1 ms of prefill a token."""

    def __init__(self, tiers: _FakeTiers, node: str) -> None:
        self.tiers, self.node = tiers, node

    def generate(self, prompt, max_tokens, params, logprobs, reset_prefix_cache=False):
        usable = (len(prompt) - 1) // 32
        load = params.get("kvmesh", {}).get("load", True)
        source = (params.get("remote_kv_source") or {}).get("remote_node_id", "")
        peer = min(self.tiers.blocks(source, prompt), usable) * 32 if source and load else 0
        local = 0 if peer or not load else min(self.tiers.blocks(self.node, prompt), usable) * 32
        if params.get("kvmesh", {}).get("save", True):
            self.tiers.saved[self.node].append(list(prompt))
        tokens = [(sum(prompt) + i) % 1000 + 2 for i in range(max_tokens)]
        report = {"source": source if peer else ("local" if local else ""), "loaded_tokens": peer + local,
                  "peer_tokens": peer, "local_tokens": local, "bytes_pulled": peer * 12 * 1024,
                  "pull_ms": 17.0 if peer else 0.0, "peer_lookup_ms": 3.1 if peer else 0.0,
                  "transfer_ms": 4.7 if peer else 0.0, "stored_blocks": len(prompt) // 32}
        return {"kv_transfer_params": {"kvmesh": report}, "num_cached_tokens": peer + local,
                "ttft_s": (len(prompt) - peer - local) * 1e-3 + 0.2, "token_ids": tokens,
                "logprobs": [[[t, -0.1], [t + 1, -2.5]] for t in tokens]}


def test_make_demo_text_report_renders_a_run(monkeypatch):
    from kvmesh_apps import demo

    monkeypatch.setattr(demo, "Router", _FakeRouter)
    tiers = _FakeTiers()
    engines = {"a": _FakeEngine(tiers, "dp1"), "b": _FakeEngine(tiers, "dp2")}
    args = argparse.Namespace(seed=7, sessions=3, turns=3, prefix_tokens=2000, user_tokens=48, max_tokens=16)
    lines: list[str] = []
    turns, outputs_match, _ = demo.run_scenario(tiers, engines, args, 32_000, lines.append)
    result = demo.summarize(turns, outputs_match, block_bytes=32 * 12 * 1024)
    demo._print_summary(result, lines.append)
    report = "\n".join(lines)
    assert len(turns) == 9 and outputs_match and result["tokens_pulled"] > 0 and result["tokens_loaded_local"] > 0
    assert re.search(r"^ +1 +0 +1 +a +2048 +0 +0 +0 +2048 ", report, re.M), report   # the first turn computes all
    assert re.search(r"^ +2 +1 +1 +b +2048 +1984 +0 +0 +64 +\d+ +\d+  dp1$", report, re.M), report   # then pulls
    for line in ("external hit rate", "bytes pulled", "TTFT p50 with pull", "outputs match"):
        assert line in report, report
    assert "negative control" not in report   # `make demo` runs without --check

    # --check's line, and a run in which nothing was pulled (no recompute to compare, no logprob difference)
    demo._print_summary({**result, "negative_control_failed": True, "negative_control_logprob_diff": 0.14,
                         "negative_control_loaded_tokens": 1984}, lines.append)
    assert "negative control (one misplaced block) fails the check: yes (logprob difference 0.14)" in lines[-1]
    none = demo.summarize([demo.Turn(0, 1, "a", 2048, computed_tokens=2048, ttft_ms=3700.0)], True, 32 * 12 * 1024)
    demo._print_summary(none, lines.append)
    assert "largest logprob difference None" in lines[-1]
