"""One PNG chart per workload from benchmarks/results/*.json (matplotlib, in the
``bench`` extra): wall time per engine for the offline runs, TTFT/ITL p50/p99 per
load level for the online ones.

    python benchmarks/plot.py            # -> benchmarks/results/*.png
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def plot_throughput(path: Path) -> Path:
    rec = json.loads(path.read_text())
    rows = [r for r in rec["summary"] if "wall_s" in r]
    labels = [r["engine"] + ("" if r["prefix_caching"] else "\n(no prefix cache)") for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(labels, [r["wall_s"] for r in rows],
                  color=["tab:green" if r["engine"] == "nanoserve" else "tab:gray" for r in rows])
    for b, r in zip(bars, rows):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{r['wall_s']:.0f} s\n{r['output_tok_s']:.0f} out tok/s",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("wall time, s (median; lower is better)")
    ax.set_title(f"{rec['workload']}: offline throughput, {rec['machine']['cores']} CPU cores ({rec['date']})",
                 fontsize=9)
    ax.margins(y=0.25)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_serve(paths: list[Path]) -> Path | None:
    recs = [json.loads(p.read_text()) for p in paths]
    if not recs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for metric, ax in zip(("ttft", "itl"), axes):
        for rec in recs:
            levels = rec.get("levels", [])
            xs = [str(l.get("level", l.get("name", i))) for i, l in enumerate(levels)]
            for q, style in (("p50", "-o"), ("p99", "--x")):
                ys = [l.get(metric, {}).get(q) for l in levels]
                if any(y is not None for y in ys):
                    ax.plot(xs, ys, style, label=f"{rec.get('engine')} {q}")
        ax.set_title(f"{metric.upper()} (ms, lower is better)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "serve.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for p in sorted(RESULTS.glob("throughput-*.json")):
        print(plot_throughput(p))
    print(plot_serve(sorted(RESULTS.glob("serve-*.json"))))
