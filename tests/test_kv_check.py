"""kvmesh_apps.kv_check: the logprob comparison behind outputs_match (no engine needed)."""

from __future__ import annotations

import math

import pytest

from kvmesh_apps.kv_check import LOGPROB_TOLERANCE, max_logprob_diff, same_computation


def test_identical_runs_differ_by_nothing() -> None:
    a = [[[5, -0.1], [6, -2.0]], [[7, -0.5], [8, -1.0]]]
    assert max_logprob_diff(a, a) == 0.0
    assert same_computation({"token_ids": [5, 7], "logprobs": a}, {"token_ids": [5, 7], "logprobs": a}) == (True, 0.0)


def test_a_token_missing_from_the_other_top_k_counts_by_its_lower_bound() -> None:
    a = [[[5, -0.1], [6, -2.0]]]
    assert max_logprob_diff(a, [[[5, -0.1], [7, -3.0]]]) == pytest.approx(1.0)  # 6: -2.0 here, <= -3.0 there


def test_missing_or_different_lengths_never_match() -> None:
    a = [[[5, -0.1]]]
    assert max_logprob_diff(a, a + a) == math.inf and max_logprob_diff(a, None) == math.inf


def test_same_tokens_with_shifted_logprobs_fail_past_the_tolerance() -> None:
    a = {"token_ids": [5], "logprobs": [[[5, -0.1]]]}
    near = {"token_ids": [5], "logprobs": [[[5, -0.1 - LOGPROB_TOLERANCE / 2]]]}
    far = {"token_ids": [5], "logprobs": [[[5, -0.1 - LOGPROB_TOLERANCE * 2]]]}
    assert same_computation(a, near)[0] and not same_computation(a, far)[0]
