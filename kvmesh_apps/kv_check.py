"""Did the right KV land in the right place? Compare what two runs of one prompt computed.

Greedy tokens alone prove little (a model may ignore most of its context). Each run returns,
per generated position, the top-K ``[token_id, logprob]`` pairs (vLLM's ``SamplingParams(logprobs=K)``);
:func:`max_logprob_diff` is the largest gap between the two runs over every position and every
token either run ranks in its top K. The run that loaded its prefix is compared with the run
that computed it; :data:`LOGPROB_TOLERANCE` was chosen from the measured fp32 CPU noise between
two correct runs (docs/engine_connector.md has the numbers), and the negative control (one
loaded block taken from the wrong slot, ``misplace_one_block``) must exceed it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Measured on the 2-core dev VM (fp32, vLLM 0.32 CPU, the test model): two recomputes in two engine processes and a
# prefix pulled from a peer vs its recompute differ by exactly 0; the same model under Hugging Face's forward, chunked
# vs whole prefill, by < 1e-5; one misplaced block moves them by 2.6. The tolerance sits 10x above the chunking
# noise and four orders of magnitude below a misplaced block (docs/engine_connector.md).
LOGPROB_TOLERANCE = 1e-4

Logprobs = Sequence[Sequence[Sequence[float]]]  # per position: [[token_id, logprob], ...]


def max_logprob_diff(a: Logprobs | None, b: Logprobs | None) -> float:
    """Largest |logprob_a - logprob_b| over positions and top-K tokens; ``inf`` when lengths differ or one is missing.

    A token in one run's top K but not the other's counts by how far it sits above the other
    run's K-th logprob (a lower bound of its true gap, so a difference is never overstated).
    """
    if a is None or b is None or len(a) != len(b):
        return math.inf
    worst = 0.0
    for step_a, step_b in zip(a, b):
        da = {int(t): float(lp) for t, lp in step_a}
        db = {int(t): float(lp) for t, lp in step_b}
        floor_a, floor_b = min(da.values()), min(db.values())
        for token in da.keys() | db.keys():
            if token in da and token in db:
                gap = abs(da[token] - db[token])
            elif token in da:
                gap = max(0.0, da[token] - floor_b)
            else:
                gap = max(0.0, db[token] - floor_a)
            worst = max(worst, gap)
    return worst


def same_computation(a: dict, b: dict, tolerance: float = LOGPROB_TOLERANCE) -> tuple[bool, float]:
    """(same tokens and logprobs within ``tolerance``, the largest logprob gap) of two engine outputs."""
    diff = max_logprob_diff(a.get("logprobs"), b.get("logprobs"))
    return a["token_ids"] == b["token_ids"] and diff <= tolerance, diff
