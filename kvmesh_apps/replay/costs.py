"""What one engine step costs: measured operator times, not the router's formula.

The simulated engine is Llama-2-70B (80 layers, 64 query / 8 KV heads of 128,
hidden 8192) on one 4-GPU tensor-parallel H100 replica. A step's time is

    80 x [linear(T) + 2 x all_reduce(T)]                       (T = tokens in the step)
  + sum over prefill chunks: attention FLOPs(q, context) / ATTENTION_FLOPS
  + sum over decodes: KV bytes read per GPU / DECODE_HBM_BYTES_PER_S
  + STEP_OVERHEAD_MS

- ``LINEAR_MS``: per layer, per GPU, the medians of every non-attention operator
  (RMSNorms, QKV projection, RoPE, output projection, gated MLP up/act/down, two
  residual adds) at tensor parallelism 4, from Vidur (Agrawal et al., MLSys'24),
  ``data/profiling/compute/h100/meta-llama/Llama-2-70b-hf/mlp.csv``
  (github.com/microsoft/vidur at 7d47513).
- ``ALLREDUCE_MS``: the median all-reduce of T x 8192 bf16 values among 4 GPUs,
  from the same repository's ``data/profiling/network/h100_dgx/all_reduce.csv``.
- Attention: Vidur's attention profiles are stored as Git LFS objects we could
  not read, so attention is costed from FLOPs at FlashAttention-2's measured H100
  throughput (Dao, ICLR'24: up to 335 TFLOPs/s; we take 300) and decode
  attention from the KV bytes it reads at 70 % of the H100 SXM's 3.35 TB/s (NVIDIA
  datasheet; the 70 % is our assumption). Both grow with context.
- ``STEP_OVERHEAD_MS`` (scheduling, sampling) is an assumption.

Between points the tables are interpolated linearly; past 4,096 tokens extrapolated
along the last segment.
"""

from __future__ import annotations

import bisect

LAYERS = 80
TENSOR_PARALLEL = 4
Q_HEADS_PER_GPU = 64 // TENSOR_PARALLEL
HEAD_DIM = 128
KV_BYTES_PER_TOKEN = 2 * LAYERS * 8 * HEAD_DIM * 2          # K and V, 80 layers, 8 KV heads, bf16: 327,680

# (tokens in the step, milliseconds per layer per GPU)
LINEAR_MS = ((1, 0.181), (16, 0.1835), (32, 0.1935), (64, 0.193), (128, 0.202), (256, 0.244), (512, 0.382),
             (768, 0.597), (1024, 0.79), (1536, 1.0495), (2048, 1.4317), (3072, 2.277), (4096, 2.8413))
ALLREDUCE_MS = ((1, 0.038), (16, 0.042), (32, 0.044), (64, 0.041), (128, 0.034), (256, 0.047), (512, 0.062),
                (768, 0.076), (1024, 0.093), (1536, 0.129), (2048, 0.167), (3072, 0.242), (4096, 0.318))
ATTENTION_FLOPS = 300e12
DECODE_HBM_BYTES_PER_S = 0.7 * 3.35e12
STEP_OVERHEAD_MS = 2.0


def _interp(table: tuple[tuple[int, float], ...], x: float) -> float:
    xs = [p[0] for p in table]
    i = min(max(bisect.bisect_left(xs, x), 1), len(table) - 1)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class StepCosts:
    """Milliseconds of one engine step; ``speed`` > 1 is a faster GPU (every term divided by it)."""

    def __init__(self, speed: float = 1.0) -> None:
        self.speed = speed
        self._dense: dict[int, float] = {}

    def dense_ms(self, tokens: int) -> float:
        """Every layer's non-attention work and its two all-reduces for ``tokens`` tokens."""
        ms = self._dense.get(tokens)
        if ms is None:
            ms = self._dense[tokens] = LAYERS * (_interp(LINEAR_MS, tokens) + 2 * _interp(ALLREDUCE_MS, tokens))
        return ms

    @staticmethod
    def prefill_attention_ms(chunk: int, context: int) -> float:
        """A causal chunk of ``chunk`` queries after ``context`` cached tokens, all layers, one GPU."""
        flops = 4 * Q_HEADS_PER_GPU * HEAD_DIM * chunk * (context + chunk / 2) * LAYERS
        return 1000.0 * flops / ATTENTION_FLOPS

    @staticmethod
    def decode_attention_ms(context_tokens: int) -> float:
        """Decodes whose contexts add up to ``context_tokens``: their KV read once per step, one GPU's share."""
        return 1000.0 * context_tokens * KV_BYTES_PER_TOKEN / TENSOR_PARALLEL / DECODE_HBM_BYTES_PER_S

    def step_ms(self, tokens: int, chunks: list[tuple[int, int]], decode_context: int) -> float:
        ms = STEP_OVERHEAD_MS + self.dense_ms(tokens) + self.decode_attention_ms(decode_context)
        for chunk, context in chunks:
            ms += self.prefill_attention_ms(chunk, context)
        return ms / self.speed

    def prefill_alone_ms(self, tokens: int, context: int, chunk_tokens: int) -> float:
        """Prefilling ``tokens`` after ``context`` cached ones on an otherwise idle engine (chunked)."""
        ms, done = 0.0, 0
        while done < tokens:
            chunk = min(chunk_tokens, tokens - done)
            ms += self.step_ms(chunk, [(chunk, context + done)], 0)
            done += chunk
        return ms


class FittedCosts(StepCosts):
    """Step costs fitted to an engine measured here (``kvmesh bench sim-to-real``): ``overhead_ms`` per step,
    ``ms_per_token`` for every token in it, ``ms_per_token_context`` for each prefilled token per token of
    context before it (attention), ``ms_per_decode_context`` per context token of each decode."""

    def __init__(self, overhead_ms: float, ms_per_token: float, ms_per_token_context: float,
                 ms_per_decode_context: float = 0.0) -> None:
        super().__init__(1.0)
        self.overhead_ms = overhead_ms
        self.ms_per_token = ms_per_token
        self.ms_per_token_context = ms_per_token_context
        self.ms_per_decode_context = ms_per_decode_context

    def step_ms(self, tokens: int, chunks: list[tuple[int, int]], decode_context: int) -> float:
        ms = self.overhead_ms + self.ms_per_token * tokens + self.ms_per_decode_context * decode_context
        for chunk, context in chunks:
            ms += self.ms_per_token_context * chunk * (context + chunk / 2)
        return ms

    @classmethod
    def fit(cls, samples: list[tuple[int, float]]) -> "FittedCosts":
        """Least squares over (prompt tokens, prefill ms from scratch) measured as one step each."""
        import numpy as np

        x = np.array([[1.0, n, n * n / 2] for n, _ in samples])
        y = np.array([ms for _, ms in samples])
        (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
        return cls(max(0.0, float(a)), max(1e-6, float(b)), max(0.0, float(c)))

    def as_dict(self) -> dict:
        return {"overhead_ms": self.overhead_ms, "ms_per_token": self.ms_per_token,
                "ms_per_token_context": self.ms_per_token_context}
