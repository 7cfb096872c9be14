"""Ctrl-C during training (trainer/interrupt.py): the first stops the run after the step
under way, evaluated and saved, and the resumed run is the run that was never stopped; the
second stops it at once; the command line exits 130. The signal is this process's own
SIGINT, as a terminal sends it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import SMALL_RUN
from test_train import deterministic, rows
from turnrl.cli import main
from turnrl.trainer.config import load_config
from turnrl.trainer.interrupt import stop_after_step_on_ctrl_c
from turnrl.trainer.loop import train

RUN = [*SMALL_RUN, "steps=5", "save_every=10", "eval.every=10"]
"""No checkpoint before the end but the one the Ctrl-C asks for."""


@pytest.fixture(autouse=True)
def python_s_own_sigint_handler() -> Iterator[None]:
    """SIGINT handled as under a terminal, by Python's own handler: a process started in
    the background (as CI may start the suite) inherits it ignored, and then turnrl
    rightly leaves it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def ctrl_c_at(step: int, times: int = 1) -> Any:
    """An ``on_row`` that presses Ctrl-C ``times`` when the row of ``step`` is written."""

    def on_row(row: dict[str, Any]) -> None:
        if row["step"] == step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs before the next bytecode

    return on_row


def test_a_ctrl_c_stops_after_the_step_under_way_and_the_resume_loses_nothing(
    tmp_path: Path,
) -> None:
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(load_config(None, RUN), straight, progress=False)
    result = train(load_config(None, RUN), stopped, progress=False, on_row=ctrl_c_at(2))
    assert result.interrupted
    assert [r["step"] for r in rows(stopped)] == [0, 1, 2, 3]  # step 3 was under way
    assert "eval/success_mean" in rows(stopped)[-1]  # the last step is evaluated
    assert (stopped / "checkpoints" / "step_000003" / "model").is_dir()  # and saved
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    resumed = train(load_config(None, RUN), stopped, resume=True, progress=False)
    assert not resumed.interrupted
    straight_rows = [deterministic(r) for r in rows(straight) if r["step"] != 3]
    stopped_rows = [deterministic(r) for r in rows(stopped) if r["step"] != 3]
    assert stopped_rows == straight_rows  # step 3's row alone adds its evaluation


def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, RUN), tmp_path / "run", progress=False, on_row=ctrl_c_at(1, 2))
    assert [r["step"] for r in rows(tmp_path / "run")] == [0, 1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_off_the_main_thread_or_under_another_handler_nothing_is_installed() -> None:
    seen: list[Any] = []

    def off_main() -> None:
        with stop_after_step_on_ctrl_c():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join(timeout=10)
    assert seen == [signal.default_int_handler]

    def own(signum: int, frame: Any) -> None:
        """A notebook's, say."""

    previous = signal.signal(signal.SIGINT, own)
    try:
        with stop_after_step_on_ctrl_c():
            assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_command_line_exits_130_after_saving_the_step_a_ctrl_c_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    many = [x for s in [*SMALL_RUN, "steps=200", "save_every=500"] for x in ("--set", s)]

    def press_after_two_steps() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    presser = threading.Thread(target=press_after_two_steps, daemon=True)
    presser.start()
    assert main(["train", "--out", str(run), "--no-progress", *many]) == 130
    presser.join(timeout=10)
    last = rows(run)[-1]["step"]
    assert 2 <= last < 200
    assert (run / "checkpoints" / f"step_{last:06d}" / "model").is_dir()
    assert "turnrl: report" in capsys.readouterr().out  # the run's files are written as ever
