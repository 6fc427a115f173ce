"""The replay's PNG: TTFT p50/p99 and prefill tokens saved per variant (matplotlib, the ``replay`` extra)."""

from __future__ import annotations

from pathlib import Path


def write_plot(result: dict, path: Path) -> str:
    """Writes the plot; returns a line saying what was written (or why not)."""
    try:
        import matplotlib
    except ImportError:
        return "no plot: install the 'replay' extra (matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    rows = [result["policies"][n] for n in names]
    x = range(len(names))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    ax1.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] / 1000 for r in rows], 0.4, label="TTFT p50")
    ax1.bar([i + 0.2 for i in x], [r["ttft_p99_ms"] / 1000 for r in rows], 0.4, label="TTFT p99")
    ax1.set_ylabel("seconds")
    ax1.set_yscale("log")
    ax1.legend()
    ax1.set_title(f"{result['trace']['requests']} requests, {result['profile']['engines']} engines: "
                  f"{result['profile']['name']}", fontsize=9)
    ax2.bar(x, [r["prefill_tokens_saved"] / 1e6 for r in rows], 0.4, label="prefill tokens saved (M)")
    ax2.bar([i + 0.4 for i in x], [r["bytes_moved"] / 1e12 for r in rows], 0.4, label="TB moved")
    ax2.legend()
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(names, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
