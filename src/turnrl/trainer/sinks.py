"""A run's per-step records beyond metrics.jsonl, and how a resume trims all of them.

metrics.jsonl stays the source of truth (the report and the monitors read it); the sinks
mirror every numeric value of every row, keyed by its metric name (docs/design.md, "Metric
names"), at the row's step, so users can watch a run in the tools they already have:
TensorBoard event files (one event per row, holding its scalars) and, optionally, W&B.

The event files are written here, synchronously, rather than by tensorboardX's
``SummaryWriter``: that one hands events to a background thread, so a run killed just
after a checkpoint lost rows the checkpoint covers, and it names files by the second and
opens them for writing, so an attempt started within the same second as the last one
overwrote that one's file. tensorboardX still supplies the protobuf classes and CRC32C.

A resumed run continues after its checkpoint's step and writes again what the killed
attempt wrote after it. ``trim_run_files`` first makes every record file (metrics.jsonl,
trajectories.jsonl, alarms.jsonl, the event files) hold only the records of steps up to
the checkpoint's, so each step has its records once; a torn last record (a run killed
mid-write) is dropped. W&B keeps what it was sent: a resumed run is a new W&B run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from turnrl.errors import ConfigError
from turnrl.trainer.config import Config

RECORD_FILES = {"metrics.jsonl": True, "trajectories.jsonl": False, "alarms.jsonl": False}
"""The run's JSON-lines record files, each with whether a step has one record in it (a
row) or may have several (trajectories, alarms)."""
EVENTS = "events.out.tfevents.*"
"""The event files under ``run_dir/tensorboard``."""


class MetricSinks:
    """Opened for one run; ``write(row)`` after each metrics row; closed at the end."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        self._events: EventFile | None = None
        self._wandb: Any = None
        if config.log.tensorboard:
            self._events = EventFile(run_dir / "tensorboard")
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
        if self._events is not None:
            self._events.write(step, scalars)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class EventFile:
    """A new TensorBoard event file in ``logdir``; each ``write`` appends one event (the
    step's scalars) and flushes it before returning."""

    def __init__(self, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        number = len(list(logdir.glob(EVENTS)))
        while True:  # a name no earlier attempt used; ``_event_files`` sorts by it
            name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{number}"
            try:
                self._file: BinaryIO = (logdir / name).open("xb")
                break
            except FileExistsError:
                number += 1
        self._append(_event_pb2().Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboardX.proto import summary_pb2  # type: ignore[import-untyped]

        values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        event = _event_pb2().Event(
            wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values)
        )
        self._append(event)

    def close(self) -> None:
        self._file.close()

    def _append(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(
            header + struct.pack("<I", _masked_crc(header)) + data
            + struct.pack("<I", _masked_crc(data))
        )  # fmt: skip
        self._file.flush()


def trim_run_files(run_dir: Path, until_step: int) -> dict[str, int]:
    """Drop from ``run_dir``'s record files every record of a step after ``until_step``
    (all of them for -1: a run restarted from scratch), every torn or unreadable one, and
    every one a later attempt wrote again (``kept``). Returns how many records each file
    lost, for the files that lost any. Cutting a file's tail truncates it in place; any
    other change writes a new copy and renames it over the old one."""
    dropped = {}
    for name, one_per_step in RECORD_FILES.items():
        path = run_dir / name
        if path.is_file():
            spans, bad = _jsonl_records(path)
            dropped[name] = _keep(path, spans, kept([s for _, _, s in spans], until_step,
                                                    one_per_step), bad)  # fmt: skip
    files = _event_files(run_dir / "tensorboard")
    read = [_event_records(path) for path in files]
    # Attempts follow one another across files, so the rule runs over all of them at once;
    # events without a step of their own (the file header) are always kept.
    steps = [s for spans, _ in read for _, _, s in spans if s is not None]
    keep = iter(kept(steps, until_step, one_per_step=False))
    for path, (spans, bad) in zip(files, read, strict=True):
        mask = [True if s is None else next(keep) for _, _, s in spans]
        dropped[f"tensorboard/{path.name}"] = _keep(path, spans, mask, bad)
    return {name: n for name, n in dropped.items() if n}


def kept(steps: Sequence[int], until_step: int, one_per_step: bool) -> list[bool]:
    """Which records of a file, their steps in the order written, a run resumed after
    ``until_step`` keeps: none of a later step, and none an earlier attempt wrote for a step
    a later attempt wrote again.

    Each attempt writes its steps in order, starting after the checkpoint it resumed from,
    so a step lower than the one written before it, or, in a file with one record per
    step, the same step again, is where a later attempt began; the records before it of
    that step or later are the earlier attempt's. Since resumes trim the files, only runs
    resumed by older versions have such records: trimming repairs them."""
    keep = [False] * len(steps)
    limit = until_step
    for i in range(len(steps) - 1, -1, -1):
        if i + 1 < len(steps):
            later = steps[i + 1]
            if steps[i] > later or (one_per_step and steps[i] == later):
                limit = min(limit, later - 1)
        keep[i] = steps[i] <= limit
    return keep


Span = tuple[int, int, Any]
"""One whole record of a file: its start and end offsets and its step (None for an event
without one)."""


def _jsonl_records(path: Path) -> tuple[list[Span], int]:
    """The whole records of a JSON-lines file (a JSON object with an integer ``step``,
    ending with a newline) and how many lines are not."""
    spans: list[Span] = []
    bad = 0
    start = 0
    with path.open("rb") as f:
        for line in f:
            end = start + len(line)
            try:
                step = json.loads(line)["step"] if line.endswith(b"\n") else None
            except (
                ValueError,
                TypeError,
                KeyError,
                RecursionError,
            ):  # RecursionError: deep nesting
                step = None
            if isinstance(step, int) and not isinstance(step, bool):
                spans.append((start, end, step))
            else:
                bad += 1
            start = end
    return spans, bad


def _event_files(logdir: Path) -> list[Path]:
    """The event files in the order their attempts wrote them: by the time in their names
    (whole seconds), then by name (ours end with a number counting the files before)."""

    def order(path: Path) -> tuple[int, int, str]:
        parts = path.name.split(".")
        seconds = int(parts[3]) if parts[3].isdigit() else 0
        number = int(parts[-1]) if len(parts) > 5 and parts[-1].isdigit() else -1
        return seconds, number, path.name

    return sorted(logdir.glob(EVENTS), key=order) if logdir.is_dir() else []


def _event_records(path: Path) -> tuple[list[Span], int]:
    """The whole records of an event file (TFRecord framing: length, its masked CRC32C,
    the serialized event, that one's CRC) and 1 if bytes follow the last whole one."""
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

    data = path.read_bytes()
    event_class = _event_pb2().Event
    spans: list[Span] = []
    pos = 0
    while pos + 12 <= len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        end = pos + 12 + length + 4
        if crc != _masked_crc(header) or end > len(data):
            break
        try:
            event = event_class.FromString(data[pos + 12 : end - 4])
        except DecodeError:
            break
        spans.append((pos, end, event.step if event.HasField("summary") else None))
        pos = end
    return spans, int(pos < len(data))


def _keep(path: Path, spans: list[Span], mask: Sequence[bool], bad: int) -> int:
    """Rewrite ``path`` to hold only its records ``mask`` keeps (``bad`` more records are
    unreadable and go too); return how many records went."""
    keep = [(start, end) for (start, end, _), k in zip(spans, mask, strict=True) if k]
    dropped = len(spans) - len(keep) + bad
    if not dropped:
        return 0
    ends = [0, *(end for _, end in keep)]
    if all(start == ends[i] for i, (start, _) in enumerate(keep)):  # a prefix of the file
        os.truncate(path, ends[-1])
        return dropped
    tmp = path.with_name(f".{path.name}.tmp")
    with path.open("rb") as source, tmp.open("wb") as out:
        for start, end in keep:
            source.seek(start)
            out.write(source.read(end - start))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    return dropped


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32C of ``data``."""
    from tensorboardX.crc32c import crc32c  # type: ignore[import-untyped]

    crc = int(crc32c(data))
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _event_pb2() -> Any:
    from tensorboardX.proto import event_pb2  # type: ignore[import-untyped]

    return event_pb2
