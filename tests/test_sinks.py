"""Metrics reach TensorBoard event files (always) and W&B in offline mode (on request)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from conftest import SMALL_RUN
from turnrl.errors import ConfigError
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train


def read_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of every event file under ``logdir``: a plain TFRecord reader (length,
    crc, payload, crc) decoding the payloads with tensorboardX's own protobuf classes."""
    from tensorboardX.proto import event_pb2  # type: ignore[import-untyped]

    out: dict[str, dict[int, float]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            payload = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_every_metric_row_reaches_tensorboard(tmp_path: Path) -> None:
    train(load_config(None, SMALL_RUN), tmp_path, progress=False)
    scalars = read_scalars(tmp_path / "tensorboard")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float):
                assert scalars[key][row["step"]] == pytest.approx(value, rel=1e-6), key


def test_tensorboard_can_be_switched_off(tmp_path: Path) -> None:
    train(load_config(None, [*SMALL_RUN, "log.tensorboard=false"]), tmp_path, progress=False)
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_offline_needs_no_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="W&B is an optional extra: pip install 'turnrl[wandb]'")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = load_config(None, [*SMALL_RUN, "log.wandb=true", "log.tensorboard=false"])
    train(config, tmp_path, progress=False)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert any(runs[0].glob("*.wandb"))  # the run's log, ready for `wandb sync`


def test_a_bad_wandb_mode_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="wandb_mode"):
        load_config(None, ["log.wandb_mode=cloud"])
