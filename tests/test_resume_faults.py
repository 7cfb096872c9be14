"""Resuming after faults: a run killed with SIGKILL at random points resumes into one
record per step in every run file, with the metrics of an uninterrupted run; a torn last
record is dropped; a damaged checkpoint (truncated, changed, a file missing, its manifest
unreadable) is reported and the one before it used; checkpoints without a manifest (written
before manifests existed) still resume."""

from __future__ import annotations

import json
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import SMALL_RUN
from turnrl.errors import ConfigError
from turnrl.trainer.checkpoint import MANIFEST, export_model, latest_checkpoint
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train
from turnrl.trainer.sinks import EventFile, kept, trim_run_files

Row = dict[str, Any]

KILLED = [*SMALL_RUN, "steps=6", "save_every=2", "log.tensorboard=true",
          # an alarm at step 3, past the first checkpoint: a killed attempt writes it too;
          # none measured from wall-clock time, whose alarms differ between attempts
          "monitor.warmup_steps=3", "monitor.window=1", "monitor.entropy_jump=1e-6",
          "monitor.slowdown_frac=0"]  # fmt: skip
"""Checkpoints after steps 2, 4 and 6; each step a fraction of a second."""


def turnrl_train(run: Path, options: list[str], *more: str) -> subprocess.Popen[bytes]:
    sets = [x for option in options for x in ("--set", option)]
    command = [sys.executable, "-m", "turnrl.cli", "train", "--out", str(run), "--no-progress"]
    with (run.parent / f"{run.name}.log").open("ab") as log:  # the child keeps its own copy
        return subprocess.Popen([*command, *sets, *more], stdout=log, stderr=log)


def steps_written(run: Path) -> list[int]:
    """The steps of metrics.jsonl's whole lines."""
    path = run / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [
        json.loads(line)["step"] for line in text.splitlines(keepends=True) if line[-1:] == "\n"
    ]


def kill_after_row(run: Path, options: list[str], step: int, *more: str) -> None:
    """Run ``turnrl train`` and SIGKILL it as soon as metrics.jsonl holds the row of
    ``step`` (the process is then in the next step's rollout or update)."""
    proc = turnrl_train(run, options, *more)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and step not in steps_written(run):
        time.sleep(0.005)
    proc.kill()  # SIGKILL
    assert proc.wait() == -signal.SIGKILL, (run.parent / f"{run.name}.log").read_text()[-3000:]
    assert step in steps_written(run), f"no row of step {step} within 120 s"


def checkpoint_step(run: Path) -> int:
    checkpoint = latest_checkpoint(run)
    assert checkpoint is not None
    return int(json.loads((checkpoint / "state.json").read_text())["step"])


def rows(run: Path) -> list[Row]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: Row) -> Row:
    """What a resumed run must reproduce exactly: no timings, and the float diagnostic
    ``train/logprob_mismatch`` left to ``same_metrics``."""
    skip = ("train/logprob_mismatch", "warmup/s")
    return {k: v for k, v in row.items() if not k.startswith("perf/") and k not in skip}


def same_metrics(resumed: list[Row], straight: list[Row]) -> None:
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in straight]
    for a, b in zip(resumed, straight, strict=True):
        mismatch = a.get("train/logprob_mismatch"), b.get("train/logprob_mismatch")
        assert mismatch == (None, None) or mismatch[0] == pytest.approx(mismatch[1], abs=1e-9)


def trajectories(run: Path) -> list[tuple[Any, ...]]:
    """Each trajectory record's step, group, task, sample, sampled ids and reward (not its
    tool calls' latencies)."""
    lines = (run / "trajectories.jsonl").read_text().splitlines()
    return [
        (t["step"], t["group"], t["task_id"], t["sample_index"], t["reward"],
         [turn["completion_ids"] for turn in t["turns"]])
        for t in map(json.loads, lines)
    ]  # fmt: skip


def events(logdir: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the event files (TFRecord framing read by
    hand; tensorboardX's protobuf classes)."""
    from tensorboardX.proto import event_pb2  # type: ignore[import-untyped]

    out = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def tear(path: Path, fragment: bytes) -> None:
    """Append what a write cut short by a kill leaves."""
    with path.open("ab") as f:
        f.write(fragment)


def test_a_run_killed_twice_resumes_into_one_record_per_step(tmp_path: Path) -> None:
    straight, run = tmp_path / "straight", tmp_path / "killed"
    uninterrupted = turnrl_train(straight, KILLED)  # side by side with the first attempt
    try:
        kill_after_row(run, KILLED, 3)  # past checkpoint 2, with the alarm of step 3 written
        assert checkpoint_step(run) == 2 < max(steps_written(run)), "the kill came too late"
        tear(run / "metrics.jsonl", b'{"step": 4, "rollout/rew')  # as if killed mid-write too
        tear(run / "trajectories.jsonl", b'{"step": 4, "group": 0, "adv')
        tear(run / "alarms.jsonl", b'{"name": "entropy_')
        (event_file,) = (run / "tensorboard").glob("events.out.tfevents.*")
        tear(event_file, struct.pack("<Q", 4000) + b"\x00\x01")
        kill_after_row(run, KILLED, 5, "--resume")  # past checkpoint 4
        assert checkpoint_step(run) == 4 < max(steps_written(run)), "the kill came too late"
        assert turnrl_train(run, KILLED, "--resume").wait(timeout=300) == 0
        assert uninterrupted.wait(timeout=300) == 0
    finally:
        uninterrupted.kill()
        uninterrupted.wait()
    alarms = [json.loads(line) for line in (straight / "alarms.jsonl").read_text().splitlines()]
    assert [(a["name"], a["step"]) for a in alarms] == [("entropy_jump", 3)]

    assert [r["step"] for r in rows(run)] == list(range(7))
    same_metrics(rows(run), rows(straight))
    assert trajectories(run) == trajectories(straight)
    assert Counter(t[0] for t in trajectories(run)) == {s: 4 for s in range(1, 7)}
    assert (run / "alarms.jsonl").read_text() == (straight / "alarms.jsonl").read_text()
    scalars = events(run / "tensorboard")
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 3  # 3 attempts
    assert Counter((tag, step) for tag, step, _ in scalars).most_common(1)[0][1] == 1
    expected = {(t, s) for t, s, _ in events(straight / "tensorboard")}
    assert {(t, s) for t, s, _ in scalars} == expected
    for row in rows(run):  # the event files hold what metrics.jsonl holds
        for tag, step, value in scalars:
            if step == row["step"] and tag in row:
                assert value == pytest.approx(row[tag], rel=1e-6), (tag, step)


def test_trimming_keeps_each_step_once_and_drops_torn_records(tmp_path: Path) -> None:
    # An older version appended each resumed attempt after the killed one's records:
    # attempt 1 wrote steps 0-4, attempt 2 resumed after 2 and wrote 3-5, attempt 3
    # resumed after 4 and is trimming; the last records were torn by the kill.
    metrics = [0, 1, 2, 3, 4, 3, 4, 5]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "attempt": a}) + "\n"
                for s, a in zip(metrics, [1, 1, 1, 1, 1, 2, 2, 2], strict=True))
        + '{"step": 6, "loss'
    )  # fmt: skip
    trajectory_steps = [1, 1, 2, 2, 3, 3, 4, 3, 3, 4, 4, 5]
    (tmp_path / "trajectories.jsonl").write_text(
        "".join(json.dumps({"step": s, "n": i}) + "\n" for i, s in enumerate(trajectory_steps))
    )
    (tmp_path / "alarms.jsonl").write_text(json.dumps({"name": "a", "step": 2}) + "\n")
    logdir = tmp_path / "tensorboard"
    for steps in ([0, 1, 2, 3, 4], [3, 4, 5]):  # one file per attempt
        sink = EventFile(logdir)
        for step in steps:
            sink.write(step, {"x": float(step)})
        sink.close()
    *_, last = sorted(logdir.glob("events.out.tfevents.*"))
    tear(last, struct.pack("<Q", 100))

    dropped = trim_run_files(tmp_path, until_step=4)

    kept_rows = rows(tmp_path)
    assert [(r["step"], r["attempt"]) for r in kept_rows] == [
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 2),
        (4, 2),
    ]
    kept_trajectories = [
        json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()
    ]
    assert [t["n"] for t in kept_trajectories] == [0, 1, 2, 3, 7, 8, 9, 10]
    assert len((tmp_path / "alarms.jsonl").read_text().splitlines()) == 1  # step 2 <= 4
    assert sorted(step for _, step, _ in events(logdir)) == [0, 1, 2, 3, 4]
    event_files = sorted(n for n in dropped if n.startswith("tensorboard/"))
    assert dropped["metrics.jsonl"] == 4
    assert dropped["trajectories.jsonl"] == 4
    assert [dropped[n] for n in event_files] == [2, 2]  # 3 and 4 | 5 and the torn record
    assert "alarms.jsonl" not in dropped
    assert trim_run_files(tmp_path, until_step=4) == {}  # nothing left to do
    trim_run_files(tmp_path, until_step=-1)  # no checkpoint: the run starts over
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert events(logdir) == []


def test_the_records_kept_rule() -> None:
    assert kept([0, 1, 2, 3], 2, one_per_step=True) == [True, True, True, False]
    assert kept([1, 1, 2, 2], 1, one_per_step=False) == [True, True, False, False]
    assert kept([0, 1, 2, 2, 3], 9, one_per_step=True) == [True, True, False, True, True]
    assert kept([2, 2, 3, 2, 2], 9, one_per_step=False) == [False, False, False, True, True]
    assert kept([0, 1, 0, 1], 9, one_per_step=True) == [False, False, True, True]


STRAIGHT = [*SMALL_RUN, "steps=3", "save_every=1", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 3 steps with a checkpoint after each."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(load_config(None, STRAIGHT), run, progress=False)
    return run


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def missing_shard(model: Path) -> None:
    """Make ``model`` a sharded model whose second shard is missing."""
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated weights": (
        lambda c: truncate(c / "model" / "model.safetensors"),
        r"model/model.safetensors has \d+ bytes, not \d+ \(truncated\?\)",
    ),
    "changed optimizer state": (
        lambda c: flip_a_byte(c / "optimizer.pt"),
        r"optimizer.pt does not match its SHA-256",
    ),
    "missing weights shard": (
        lambda c: (c / "model" / "model.safetensors").unlink(),
        r"model/model.safetensors is missing",
    ),
    "missing state": (lambda c: (c / "state.json").unlink(), r"state.json is missing"),
    "unreadable manifest": (lambda c: truncate(c / MANIFEST), r"manifest.json is unreadable"),
    "no manifest, truncated weights": (
        lambda c: ((c / MANIFEST).unlink(), truncate(c / "model" / "model.safetensors")),
        r"model/model.safetensors is shorter or longer than its header says",
    ),
    "no manifest, missing shard": (
        lambda c: ((c / MANIFEST).unlink(), missing_shard(c / "model")),
        r"model/model-00002-of-00002.safetensors is missing",
    ),
    "no manifest, half deleted": (  # as an interrupted rmtree could leave it
        lambda c: ((c / MANIFEST).unlink(), (c / "model" / "tokenizer_config.json").unlink()),
        r"model/tokenizer_config.json is missing",
    ),
    "no manifest, truncated optimizer state": (
        lambda c: ((c / MANIFEST).unlink(), truncate(c / "optimizer.pt")),
        r"optimizer.pt is cut short",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_the_one_before_used(
    damage: str, straight_run: Path, tmp_path: Path
) -> None:
    run = copy_run(straight_run, tmp_path / "run")
    newest = run / "checkpoints" / "step_000003"
    assert (run / "checkpoints" / "latest").read_text() == newest.name
    harm, problem = DAMAGE[damage]
    harm(newest)
    said: list[str] = []
    assert latest_checkpoint(run, warn=said.append) == run / "checkpoints" / "step_000002"
    (message,) = said
    assert str(newest) in message
    assert re.search(problem, message), message
    if (newest / MANIFEST).is_file():  # export checks a checkpoint it is pointed at, too
        with pytest.raises(ConfigError, match="is damaged"):
            export_model(run, tmp_path / "export", step=3)


def test_a_resume_falls_back_past_a_damaged_checkpoint(
    straight_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = copy_run(straight_run, tmp_path / "run")
    flip_a_byte(run / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    train(load_config(None, STRAIGHT), run, resume=True, progress=False)
    assert "step_000003 is damaged (model/model.safetensors does not match" in caplog.text
    assert "resuming after step 2: dropped 1 record(s) of metrics.jsonl" in caplog.text
    assert [r["step"] for r in rows(run)] == [0, 1, 2, 3]
    same_metrics(rows(run), rows(straight_run))
    assert trajectories(run) == trajectories(straight_run)


def test_with_every_checkpoint_damaged_a_resume_is_a_clear_error(
    straight_run: Path, tmp_path: Path
) -> None:
    run = copy_run(straight_run, tmp_path / "run")
    for checkpoint in (run / "checkpoints").glob("step_*"):
        truncate(checkpoint / "optimizer.pt")
    with pytest.raises(ConfigError, match=r"no usable checkpoint in .*every one is damaged: "
                       r"step_000003: optimizer.pt has .* \| step_000002: .* \| step_000001"):  # fmt: skip
        train(load_config(None, STRAIGHT), run, resume=True, progress=False)
    assert len(rows(run)) == 4  # nothing trimmed


def test_checkpoints_without_a_manifest_still_resume(straight_run: Path, tmp_path: Path) -> None:
    run = copy_run(straight_run, tmp_path / "run")
    for checkpoint in (run / "checkpoints").glob("step_*"):
        (checkpoint / MANIFEST).unlink()  # as written before manifests existed
    shutil.rmtree(run / "checkpoints" / "step_000003")
    said: list[str] = []
    assert latest_checkpoint(run, warn=said.append) == run / "checkpoints" / "step_000002"
    assert said == []
    train(load_config(None, STRAIGHT), run, resume=True, progress=False)
    same_metrics(rows(run), rows(straight_run))
