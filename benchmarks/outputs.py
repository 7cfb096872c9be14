"""Where a benchmark writes, and its ``--smoke`` mode.

Every benchmark script takes ``--out PATH`` (its results: PATH.json and PATH.md; by default
benchmarks/results/NAME) and ``--smoke``: the same code path on tiny settings, in seconds,
to show that the script still runs. Scripts that train or build models also take
``--runs-dir DIR`` (their run directories and models; by default benchmarks/runs). With
``--smoke`` everything goes into one folder: ``--out``'s, or else a fresh temporary one.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent


def parse_args(
    parser: argparse.ArgumentParser, name: str, smoke: dict[str, Any], runs: bool = False
) -> argparse.Namespace:
    """``parser``'s arguments with ``--smoke``, ``--out`` (and ``--runs-dir``) added and
    resolved. With ``--smoke``, ``smoke`` replaces the defaults of the script's own options
    (a flag given on the command line still wins)."""
    parser.add_argument(
        "--smoke", action="store_true",
        help="tiny settings (seconds), written to a temporary directory unless --out is given",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None,
        help=f"results path, .json and .md added (default: benchmarks/results/{name})",
    )  # fmt: skip
    if runs:
        parser.add_argument(
            "--runs-dir", type=Path, default=None,
            help="run directories and built models (default: benchmarks/runs)",
        )  # fmt: skip
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**smoke)
    args = parser.parse_args()
    if args.smoke:
        folder = args.out.parent if args.out else Path(tempfile.mkdtemp(prefix=f"{name}-smoke-"))
        args.out = args.out or folder / name
        if runs:
            args.runs_dir = args.runs_dir or folder / "runs"
        print(f"--smoke: writing to {folder}", flush=True)
    else:
        args.out = args.out or ROOT / "results" / name
        if runs:
            args.runs_dir = args.runs_dir or ROOT / "runs"
    return args
