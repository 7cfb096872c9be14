"""report.html without a browser: it survives a killed run's torn files and a missing
tokenizer, embeds parseable data, and `turnrl train` rewrites it while the run goes on."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import SMALL_RUN
from turnrl.cli import _report_every
from turnrl.report import write_report
from turnrl.report.html import layout, svg_chart
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    train(load_config("quickstart", [*SMALL_RUN, "steps=2"]), out, progress=False)
    return out


def embedded(report: Path) -> list[dict[str, object]]:
    found = re.search(r"id='episode-data'>(.*?)</script>", report.read_text(), re.S)
    assert found is not None
    data: list[dict[str, object]] = json.loads(found[1].replace("<\\/", "</"))
    return data


def test_a_killed_runs_files_and_a_missing_tokenizer_still_give_a_report(
    run_dir: Path, tmp_path: Path
) -> None:
    killed = tmp_path / "killed"
    shutil.copytree(run_dir, killed)
    for name in ("metrics.jsonl", "trajectories.jsonl"):
        with (killed / name).open("a") as f:
            f.write('{"step": 9, "torn')  # a line cut short by the kill
    for model_dir in ("start_model", "base_model", "checkpoints"):
        shutil.rmtree(killed / model_dir, ignore_errors=True)
    episodes = embedded(write_report(killed))
    assert episodes
    first_turn = episodes[0]["turns"][0]  # type: ignore[index]
    assert all(re.fullmatch(r"\[\d+\]", p) for p in first_turn["prompt"])  # ids, not text


def test_the_report_shows_where_a_step_s_time_goes_and_how_stale_its_batch_was(
    run_dir: Path,
) -> None:
    """The step's wall time beside its rollout's (and, asynchronous, the wait for the batch
    collected ahead), and the batch's lag behind the learner: what max_staleness changes."""
    html = write_report(run_dir).read_text()
    for title in ("step time (s)", "policy versions behind the learner"):
        assert f">{title}<" in html
    for key in ("perf/step_s", "perf/rollout_s", "rollout/policy_lag_max"):
        assert key in html


def test_the_report_says_where_the_run_ran_and_charts_its_syncs_and_staleness(
    run_dir: Path, tmp_path: Path
) -> None:
    """The layout in words (ranks, workers, how far rollouts ran ahead), the staleness
    histogram and the weight syncs as curves, and worker restarts only where there were
    some."""
    assert layout({}) == "in process, synchronous"
    config = {
        "cluster": {"learner_ranks": 2, "learner_placement": "ray", "rollout_workers": 4,
                    "weight_sync": "broadcast", "address": "10.0.0.1:6379"},
        "algorithm": {"max_staleness": 2, "partial_rollouts": True, "overlap_batches": False},
    }  # fmt: skip
    assert layout(config) == (
        "2 learner rank(s) (FSDP2 on Ray), 4 rollout worker(s) (weight_sync broadcast), "
        "Ray cluster 10.0.0.1:6379, asynchronous: max_staleness 2, partial rollouts"
    )
    html = write_report(run_dir).read_text()
    assert "<th>layout</th><td>in process, synchronous</td>" in html
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1:]:  # as a run on two workers, one step deep, writes them
        r.update({"rollout/staleness_0": 0.0, "rollout/staleness_1": 1.0,
                  "perf/rollout_sync_s": 0.02, "rollout/worker_restarts": 0.0})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = write_report(run).read_text()
    for title in ("trajectories by versions behind (fraction)", "weight sync (s)"):
        assert f">{title}<" in html
    assert "rollout worker restarts" not in html  # none happened
    rows[-1]["rollout/worker_restarts"] = 1.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ">rollout worker restarts<" in write_report(run).read_text()


def test_tokens_are_decoded_with_the_runs_tokenizer(run_dir: Path) -> None:
    episodes = embedded(write_report(run_dir))
    text = "".join(episodes[0]["turns"][0]["prompt"])  # type: ignore[index]
    assert "<|im_start|>" in text


def test_chart_marks_alarms_and_survives_flat_or_single_points() -> None:
    svg = svg_chart("x", {"a": [(1.0, 2.0)], "b": [(1.0, 3.0), (2.0, 3.0)]},
                    [{"step": 1, "name": "spike", "metric": "a"}])  # fmt: skip
    assert "<circle" in svg
    assert "<polyline" in svg
    assert "class='alarm'" in svg
    assert "spike at step 1" in svg


def test_train_rewrites_the_report_while_running(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "running"
    shutil.copytree(run_dir, copy)
    (copy / "report.html").unlink(missing_ok=True)
    on_row = _report_every(copy, seconds=0.0)
    on_row({"step": 1})
    assert (copy / "report.html").is_file()
