"""``replay.png``: goodput against load, and the highest SLO-meeting rate against each swept parameter."""

from __future__ import annotations

from pathlib import Path


def write_plot(result: dict, path: Path) -> str:
    """Writes the plot; returns a line saying what was written (or why not)."""
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result.get("sweep", [])
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    ax = axes[0][0]
    if sweep:
        load = [p for p in sweep if "time_scale" in p["point"]]
        for name in load[0]["policies"]:
            xs = [p["point"]["arrival_rate_rps"] for p in load]
            ax.errorbar(xs, [p["policies"][name]["goodput_rps"] for p in load],
                        yerr=[p["policies"][name]["goodput_rps_ci95"] or 0.0 for p in load],   # None: one window
                        marker="o", ms=3, label=name)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"goodput (req/s, TTFT <= prefill alone + {result['trace']['ttft_slo_ms'] / 1000:g} s)")
        ax.set_title("goodput against load", fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[0][1]
        for name in load[0]["policies"]:
            ax.plot([p["point"]["arrival_rate_rps"] for p in load],
                    [p["policies"][name]["ttft_p90_ms"] / 1000 for p in load], marker="o", ms=3, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("TTFT p90 (s)")
        ax.set_title("TTFT p90 against load", fontsize=9)
        prof = result["profile"]
        defaults = {"inter_rack_gbytes_per_s": prof["inter_rack_bytes_per_s"] / 1e9, "speed": prof["speed"],
                    "cpu_tier_blocks": prof["cpu_tier_blocks"], "event_delay_ms": result["trace"]["event_delay_ms"]}
        for ax, param in zip([axes[0][2], axes[1][0], axes[1][1], axes[1][2]], list(defaults)):
            pts = [p for p in sweep if param in p["point"]]
            if not pts:
                continue
            default = {"point": {param: defaults[param]}, "policies": load[0]["policies"]}  # the default point
            pts = sorted(pts + [default], key=lambda p: p["point"][param])
            for name in pts[0]["policies"]:
                ax.plot([p["point"][param] for p in pts], [p["policies"][name]["max_slo_rate_rps"] for p in pts],
                        marker="o", ms=3, label=name)
            ax.axvline(defaults[param], color="grey", lw=0.5, ls=":")
            if param == "event_delay_ms":
                ax.set_xscale("symlog", linthresh=10)
                ax.set_xlim(left=0)
            else:
                ax.set_xscale("log")
            ax.set_xlabel(param)
            ax.set_ylabel("highest SLO-meeting rate (req/s)")
            ax.set_title(f"SLO-meeting rate against {param}", fontsize=9)
    else:
        names = list(result["policies"])
        rows = [result["policies"][n] for n in names]
        x = range(len(names))
        ax.bar(list(x), [r["goodput_rps"] for r in rows], yerr=[r["goodput_rps_ci95"] or 0.0 for r in rows])
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("goodput (req/s)")
        for a in list(axes[0][1:]) + list(axes[1]):
            a.axis("off")
    fig.suptitle(f"{result['profile']['name']}; {result['profile']['engines']} engines", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"
