"""Metric sinks beyond metrics.jsonl: TensorBoard event files and, optionally, W&B.

metrics.jsonl stays the source of truth (the report and the monitors read it); the sinks
mirror every numeric value of every row, keyed by its DESIGN.md metric name, at the row's
step, so users can watch a run in the tools they already have.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import TracebackType
from typing import Any

from turnrl.errors import ConfigError
from turnrl.trainer.config import Config


class MetricSinks:
    """Opened for one run; ``write(row)`` after each metrics row; closed at the end."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        self._writers: list[Any] = []
        self._wandb: Any = None
        if config.log.tensorboard:
            from tensorboardX import SummaryWriter  # type: ignore[import-untyped]

            self._writers.append(SummaryWriter(logdir=str(run_dir / "tensorboard")))
        if config.log.wandb:
            try:
                import wandb
            except ImportError as exc:
                raise ConfigError(
                    "log.wandb = true needs Weights & Biases: pip install 'turnrl[wandb]'"
                ) from exc
            self._wandb = wandb.init(
                project=config.log.wandb_project,
                name=run_dir.name,
                dir=str(run_dir),
                mode=config.log.wandb_mode,
                config=dataclasses.asdict(config),
                reinit=True,
            )

    def write(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        scalars = {
            k: float(v)
            for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and math.isfinite(float(v))
        }
        for writer in self._writers:
            for key, value in scalars.items():
                writer.add_scalar(key, value, global_step=step)
            writer.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
