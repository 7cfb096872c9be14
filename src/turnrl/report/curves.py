"""Learning curves of a run as one PNG (``learning_curve.png``), and the entry point that
also writes ``report.html`` (``turnrl.report.html``).

Reads only ``metrics.jsonl``, so it works on a finished, running or killed run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from turnrl.trainer.monitors import read_rows

PANELS = (
    ("success", ("rollout/success_mean", "eval/success_mean")),
    ("reward", ("rollout/reward_mean", "rollout/reward_std_in_group")),
    ("tool use", ("rollout/tool_calls_mean", "rollout/tool_errors_frac")),
    ("policy", ("loss/entropy", "train/clip_frac", "train/logprob_mismatch")),
)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``; a torn last line (a killed run) is skipped."""
    return read_rows(Path(run_dir) / "metrics.jsonl")


def write_curves(run_dir: Path) -> Path:
    """Draw ``learning_curve.png`` in the run directory and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (title, keys) in zip(axes, PANELS, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 20 else None, ms=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(run_dir) / "learning_curve.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def write_report(run_dir: Path) -> Path:
    """Draw ``learning_curve.png`` and write the self-contained ``report.html``."""
    from turnrl.report.html import write_html_report

    write_curves(run_dir)
    return write_html_report(run_dir)
