"""How far bf16 autocast moves the learner's update, against the batch's own sampling noise.

At every step of a float32 quick-start run, on the batch that step trains on and from the
weights it starts from, this computes the first pass's gradient twice, in float32 and under
bf16 autocast (``model.precision = "bf16-mixed"``'s compute), and compares them: their
cosine and relative error, and the cosine of the Adam updates they give from the
optimizer's state as it is. For scale, it also takes the cosine between the float32
gradients of the batch's two halves, which differ only by what was sampled. The halves are the
alternate rows of every micro-batch (sorted by length, so the two are alike). The run itself
steps with its float32 gradients (both passes of ``epochs = 2``): it is the float32 run,
with three more gradient computations a step that change nothing in it. The run is
``turnrl.train``'s, its learner made by its ``make_learner`` hook (the in-process learner,
its class swapped for ``ComparingLearner``); before issue 55 it called the trainer's loop
with the same hook directly: the same run.

    python benchmarks/bf16_gradients.py           # seed 1, 60 steps, one thread (~12 min)
    python benchmarks/bf16_gradients.py --smoke   # a tiny model, 2 steps (seconds)

Writes benchmarks/results/bf16_gradients.json (every step's numbers) and .md (their ranges);
the run directory goes to benchmarks/runs (``--out``, ``--runs-dir``; ``--smoke``: a
temporary directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from outputs import parse_args
from training_runs import TINY_RUN, write_results
from turnrl import load_config, train
from turnrl.rollout import Batch
from turnrl.trainer import Learner, LearnerSpec, in_process_learner


def flat_grad(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every parameter's gradient in one float64 vector (zeros where there is none)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
            for p in params
        ]
    ).double()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Their cosine, or None where one is zero (a batch whose advantages are all zero and
    no KL yet: nothing to compare)."""
    norms = float(a.norm() * b.norm())
    return float(a @ b) / norms if norms > 0 else None


def adam_update(optimizer: torch.optim.Optimizer, grad: torch.Tensor) -> torch.Tensor:
    """The direction AdamW's next step would take with ``grad``, from its state as it is
    (bias-corrected first moment over the root of the second, weight decay left out)."""
    group = optimizer.param_groups[0]
    (b1, b2), eps = group["betas"], group["eps"]
    ms, vs, step = [], [], 0
    for p in group["params"]:
        state = optimizer.state.get(p, {})
        if "exp_avg" in state:
            ms.append(state["exp_avg"].reshape(-1).double())
            vs.append(state["exp_avg_sq"].reshape(-1).double())
            step = int(state["step"])
        else:
            ms.append(torch.zeros(p.numel(), dtype=torch.float64))
            vs.append(torch.zeros(p.numel(), dtype=torch.float64))
    m, v, t = torch.cat(ms), torch.cat(vs), step + 1
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    return (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)


class ComparingLearner(Learner):
    """The in-process learner, which before each update measures bf16's gradient against
    float32's on the same batch (optimizer steps switched off while it does)."""

    records: list[dict[str, float | None]]

    def _gradient(self, batch: Batch | Sequence[Batch], autocast: torch.dtype | None) -> Any:
        self.autocast = autocast
        super().step(batch)
        return flat_grad(self.params)

    def step(self, batch: Batch | Sequence[Batch]) -> dict[str, float]:
        config, optimizer_step = self.config, self.optimizer.step
        self.config = dataclasses.replace(config, epochs=1)  # the first pass's gradient
        self.optimizer.step = lambda *args, **kwargs: None  # type: ignore[method-assign]
        try:
            g16 = self._gradient(batch, torch.bfloat16)
            # alternate rows of every micro-batch (sorted by length): two like halves
            micro = self.micro_batches(batch)
            evens = [mb.select(slice(0, None, 2)) for mb in micro]
            odds = [mb.select(slice(1, None, 2)) for mb in micro if mb.num_sequences > 1]
            halves = None
            if odds:
                halves = cosine(self._gradient(evens, None), self._gradient(odds, None))
            g32 = self._gradient(batch, None)
        finally:
            self.config, self.optimizer.step = config, optimizer_step  # type: ignore[method-assign]
        self.records.append(
            {
                "step": len(self.records) + 1,
                "grad_cosine": cosine(g16, g32),
                "grad_relative_error": (
                    float((g16 - g32).norm() / g32.norm()) if g32.norm() > 0 else None
                ),
                "adam_update_cosine": cosine(
                    adam_update(self.optimizer, g16), adam_update(self.optimizer, g32)
                ),
                "halves_cosine": halves,
                "grad_norm": float(g32.norm()),
            }
        )
        return super().step(batch)  # the float32 update, as the run would take it


def cpu_name() -> str:
    """The CPU's model name, family and model, from /proc/cpuinfo (Linux), else the
    platform's: the float rounding, and so the run, depend on it."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    family, model = info.get("cpu family", "?"), info.get("model", "?")
    return f"{info.get('model name', '?')}, family {family} model {model}"


def spread(values: list[float | None]) -> dict[str, float]:
    """Min, median and max of ``values`` (None: not measured that step)."""
    present = [v for v in values if v is not None]
    if not present:
        return {}
    return {"min": min(present), "median": statistics.median(present), "max": max(present)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    args = parse_args(parser, "bf16_gradients", {"steps": 2}, runs=True)
    overrides = [f"seed={args.seed}", "threads=1", "max_minutes=0", "save_every=100000"]
    # --smoke: an entropy term, so that two steps of 4 episodes have a gradient to compare
    overrides += [*TINY_RUN, "algorithm.entropy_coef=0.01"] if args.smoke else []
    overrides.append(f"steps={args.steps}")
    config = load_config("quickstart", overrides)
    records: list[dict[str, float | None]] = []

    def make_learner(spec: LearnerSpec) -> Learner:
        learner = in_process_learner(spec)
        learner.__class__ = ComparingLearner
        learner.records = records  # type: ignore[attr-defined]
        return learner

    run_dir = args.runs_dir / f"bf16-gradients-seed{args.seed}"
    t0 = time.perf_counter()
    result = train(config, out=run_dir, progress=not args.smoke, make_learner=make_learner)
    curve = [
        (int(r["step"]), r["eval/success_mean"]) for r in result.rows if "eval/success_mean" in r
    ]
    keys = ("grad_cosine", "grad_relative_error", "adam_update_cosine", "halves_cosine")
    summary = {k: spread([r[k] for r in records]) for k in keys}
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_name()}, torch {torch.__version__}",
        "seed": args.seed,
        "steps": len(records),
        "overrides": overrides,
        "run_dir": str(run_dir),
        "minutes": (time.perf_counter() - t0) / 60,
        "summary": summary,
        "curve": curve,
    }
    names = {
        "grad_cosine": "gradient cosine, bf16 vs float32",
        "grad_relative_error": "gradient relative error, bf16 vs float32",
        "adam_update_cosine": "Adam update cosine, bf16 vs float32",
        "halves_cosine": "gradient cosine, the batch's two halves (float32)",
    }
    lines = [
        f"# bf16 autocast against the batch's own noise ({meta['date']}, {meta['machine']})",
        "",
        f"The quick-start in float32, seed {args.seed}, {len(records)} steps, one thread; at every "
        "step the first pass's gradient on that step's batch from that step's weights "
        "(`python benchmarks/bf16_gradients.py`).",
        "",
        "| measure | min | median | max |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {names[k]} | {s['min']:.4f} | {s['median']:.4f} | {s['max']:.4f} |"
        for k, s in summary.items()
        if s
    ]
    lines += ["", "Held-out success (step:success): " + ", ".join(f"{s}:{v:.2f}" for s, v in curve)]
    write_results(args.out, meta, records, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
