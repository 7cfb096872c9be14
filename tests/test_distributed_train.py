"""`turnrl train` with the learner on ranks (``cluster.learner_ranks``) against the
in-process run, end to end: real rank processes, real torch.distributed (gloo, CPU), the
quick-start recipe on the small-run settings (GiGPO, two epochs, a KL to the reference in
the loss). The same seed gives the in-process metrics (1 rank: equal up to float rounding;
2 ranks: within 1e-5); checkpoints are the in-process ones, so a group's run resumes in
process; a rank killed mid-run stops the run naming the rank, and it resumes; the command
line runs it."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SMALL_RUN
from turnrl.api import train
from turnrl.distributed import LearnerGroup, LearnerRankError
from turnrl.errors import ConfigError
from turnrl.models import load_model
from turnrl.models.tiny import TinyModelConfig, build_tiny_model
from turnrl.trainer.config import Config, load_config
from turnrl.trainer.loop import train as train_in_process

Row = dict[str, Any]

# Two ranks split each batch (and each rank its micro-batches) differently from one
# process, so the gradient's sums are taken in another order: float32 rounding (one
# update's gradient within 1e-5: tests/test_distributed_learner.py). Measured here: every
# metric within 3e-7 relative over three steps, so 1e-5 (and 1e-6 absolute, for values
# near 0). The sampled tokens are the same (a rounding-size change moves no sample here).
REL, ABS = 1e-5, 1e-6
LR = 0.01
WEIGHTS_ABS = 0.1 * LR
"""The weights carry the rounding further: Adam divides each gradient element by its own
running size, so an element near Adam's eps (1e-8) turns a rounding-size difference into
a visible fraction of its step (at most ``lr`` per optimizer step). Measured: 1.4e-4
after two steps and 2e-4 after three at lr 0.01, 1e-5 after three at lr 1e-3 (in
proportion to lr, as that explanation says). Bound: a tenth of one step."""

RUN = [
    *SMALL_RUN,
    # Something to learn from a random tiny model in three steps: an entropy bonus (a
    # gradient every step, so the weights and then the KL to the reference move) and the
    # soft overlong penalty (rewards differ by length within a group: advantages, a policy
    # loss, clipping).
    "algorithm.entropy_coef=0.05",
    f"algorithm.lr={LR}",
    "algorithm.overlong.penalty_tokens=16",
    "rollout.max_episode_tokens=24",
]


def config(steps: int, ranks: int, *more: str) -> Config:
    return load_config(None, [*RUN, f"steps={steps}", f"cluster.learner_ranks={ranks}", *more])


def rows(run_dir: Path) -> list[Row]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: Row) -> Row:
    """A row without wall-clock times (``perf/``, ``warmup/s``)."""
    return {k: v for k, v in row.items() if not k.startswith("perf/") and k != "warmup/s"}


def differences(got: list[Row], expected: list[Row]) -> dict[str, float]:
    """The largest relative difference of each metric (absolute where the expected value
    is below 1), over the rows given; the key sets must be equal."""
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    out: dict[str, float] = {}
    for a, b in zip(got, expected, strict=True):
        a, b = deterministic(a), deterministic(b)
        assert sorted(a) == sorted(b), set(a) ^ set(b)
        for key, value in b.items():
            diff = abs(a[key] - value) / max(1.0, abs(value))
            out[key] = max(out.get(key, 0.0), diff)
    return out


def assert_close(got: list[Row], expected: list[Row]) -> None:
    for a, b in zip(got, expected, strict=True):
        a, b = deterministic(a), deterministic(b)
        assert sorted(a) == sorted(b), set(a) ^ set(b)
        for key, value in b.items():
            assert a[key] == pytest.approx(value, rel=REL, abs=ABS), (a["step"], key)


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return dict(load_model(checkpoint / "model").state_dict())


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def files(checkpoint: Path) -> list[str]:
    return sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same seed three ways: in process (3 steps), 1 rank and 2 ranks (2 steps each)."""
    root = tmp_path_factory.mktemp("runs")
    out = {"in_process": root / "in_process", "one": root / "one", "two": root / "two"}
    train(config(3, 0), out=out["in_process"], progress=False)
    train(config(2, 1), out=out["one"], progress=False)
    train(config(2, 2), out=out["two"], progress=False)
    return out


def test_one_rank_gives_the_in_process_run(runs: dict[str, Path]) -> None:
    """1 rank runs the in-process learner's code on the whole batch (through FSDP2's root
    call), in the same order: the weights are bitwise the in-process ones, and so is every
    metric here. The one operation that may round is the metrics' combination over ranks
    (x * n / n, for values summed in float64): 1e-12 allows it."""
    got, expected = rows(runs["one"]), rows(runs["in_process"])[:3]
    assert max(differences(got, expected).values()) < 1e-12
    one, same = (r / "checkpoints" / "step_000002" for r in (runs["one"], runs["in_process"]))
    assert max_diff(weights(one), weights(same)) == 0.0
    assert "perf/weight_sync_s" in got[1]


def test_two_ranks_give_the_in_process_run_within_1e_5(runs: dict[str, Path]) -> None:
    got, expected = rows(runs["two"]), rows(runs["in_process"])[:3]
    assert_close(got, expected)
    assert max(r.get("loss/policy", 0) for r in got) > 0  # advantages were learned from
    assert got[-1]["loss/kl"] > 0  # the KL to the reference is in the loss, on every rank
    two = runs["two"] / "checkpoints" / "step_000002"
    same = runs["in_process"] / "checkpoints" / "step_000002"
    assert files(two) == files(same)  # the in-process checkpoint, file for file
    assert max_diff(weights(two), weights(same)) < WEIGHTS_ABS
    a = torch.load(two / "optimizer.pt", weights_only=True)
    b = torch.load(same / "optimizer.pt", weights_only=True)
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])


def test_a_two_rank_run_resumes_in_process(runs: dict[str, Path], tmp_path: Path) -> None:
    """The group's checkpoint (weights and optimizer state) continues in process: step 3
    and its weights are the in-process run's (a wrong optimizer state would move them)."""
    run = tmp_path / "two_then_in_process"
    shutil.copytree(runs["two"], run)
    result = train(config(3, 0), out=run, resume=True, progress=False)
    assert [r["step"] for r in result.rows] == [3]
    assert_close(result.rows, rows(runs["in_process"])[3:])
    got, expected = (r / "checkpoints" / "step_000003" for r in (run, runs["in_process"]))
    # A lost optimizer state would move some weights by a whole step (lr): far outside.
    assert max_diff(weights(got), weights(expected)) < WEIGHTS_ABS


def groups_alive() -> list[LearnerGroup]:
    """The learner groups of this process that have not been closed."""
    return [o for o in gc.get_objects() if type(o) is LearnerGroup and not o._closed]


def test_a_killed_rank_stops_the_run_naming_it_and_the_run_resumes(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Rank 1 is killed once checkpoint 1 is written (step 2 is then sampling): the run
    stops with an error naming the rank and the checkpoint to resume from, no rank is left
    behind, and ``--resume`` (2 ranks again) repeats step 2 as the in-process run did."""
    run = tmp_path / "killed"
    killed: list[int] = []

    def kill_after_checkpoint_1() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (run / "checkpoints" / "latest").exists():
            time.sleep(0.01)
        for group in groups_alive():
            killed.extend(group.pids)
            os.kill(group.pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_after_checkpoint_1, daemon=True)
    killer.start()
    with pytest.raises(LearnerRankError) as caught:
        train(config(3, 2), out=run, progress=False)
    killer.join()
    message = str(caught.value)
    assert caught.value.ranks == (1,)
    assert "learner rank 1 died (exit code -9) during" in message
    assert caught.value.call.endswith(" 2")  # in step 2
    assert "newest whole checkpoint is step_000001: continue it with --resume" in message
    assert len(killed) == 2
    for pid in killed:  # no rank outlives the run
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    result = train(config(3, 2), out=run, resume=True, progress=False)
    assert [r["step"] for r in rows(run)] == [0, 1, 2, 3]
    assert_close(result.rows, rows(runs["in_process"])[2:])
    assert groups_alive() == []


def test_the_command_line_trains_on_two_ranks(runs: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "cli"
    sets = [a for s in [*RUN, "cluster.learner_ranks=2"] for a in ("--set", s)]
    done = subprocess.run(
        [sys.executable, "-m", "turnrl.cli", "train", *sets, "--out", str(run), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert_close(rows(run), rows(runs["in_process"])[:3])
    assert json.loads((run / "config.json").read_text())["cluster"]["learner_ranks"] == 2


def test_two_ranks_checkpointing_activations_give_the_in_process_run(
    tmp_path: Path,
) -> None:
    """``model.gradient_checkpointing`` on the ranks (each recomputes its layers in the
    backward, as the in-process learner does): the in-process run with it, within 1e-5.
    At lr 1e-3: at the module's 0.01, Adam's amplification of gradient rounding (see
    ``WEIGHTS_ABS``) moved step 2's KL by 2.2e-5 (3e-3 relative; 1e-10 at lr 1e-3,
    measured), while one update's gradient agrees within 2e-8 either way
    (tests/test_distributed_learner.py)."""
    out = {}
    for name, ranks in (("in_process", 0), ("two", 2)):
        out[name] = tmp_path / name
        more = ["model.gradient_checkpointing=true", "algorithm.lr=0.001"]
        train(config(2, ranks, *more), out=out[name], progress=False)
    assert_close(rows(out["two"]), rows(out["in_process"]))


@pytest.mark.parametrize("staleness", [0, 1])
def test_lora_on_two_ranks_gives_the_in_process_run(tmp_path: Path, staleness: int) -> None:
    """LoRA adapters trained on two ranks (the frozen base sharded with them; the KL
    reference the base, adapters off; after each update only the adapters come back to
    the driver's model, which the engine samples from, one version behind with
    ``max_staleness`` 1): the in-process LoRA run within 1e-5, and its checkpoint holds
    only the adapters, as in process, equal within a tenth of a step."""
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.kl.coef=0.05",
            f"algorithm.max_staleness={staleness}"]  # fmt: skip
    out = {}
    for name, ranks in (("in_process", 0), ("two", 2)):
        out[name] = tmp_path / name
        train(config(2, ranks, *lora), out=out[name], progress=False)
    got = rows(out["two"])
    assert_close(got, rows(out["in_process"]))
    assert got[-1]["loss/kl"] > 0  # the adapters moved the policy away from the base
    assert all(r.get("rollout/staleness_1", 0.0) == float(staleness) for r in got[2:])
    two, same = (out[k] / "checkpoints" / "step_000002" for k in ("two", "in_process"))
    assert files(two) == files(same)
    assert "model/adapter_model.safetensors" in files(two)
    assert max_diff(weights(two), weights(same)) < WEIGHTS_ABS


def test_lora_on_an_untied_model_on_two_ranks_gives_the_in_process_run(tmp_path: Path) -> None:
    """Separate input and output embeddings are units of their own, and the root's call
    leaves the output layer out (rank.py's ``_without_head``, through peft's wrapper
    here): three LoRA steps on two ranks are the in-process run's."""
    untied = TinyModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, vocab_size=1024, tie_word_embeddings=False
    )
    model = build_tiny_model(tmp_path / "untied", untied)
    lora = [f"model.path={model}", "model.lora.rank=4", "model.lora.alpha=8"]
    out = {}
    for name, ranks in (("in_process", 0), ("two", 2)):
        out[name] = tmp_path / name
        train(config(3, ranks, *lora, "algorithm.kl.coef=0.05"), out=out[name], progress=False)
    assert_close(rows(out["two"]), rows(out["in_process"]))


PPO = ["algorithm.advantage=gae", "algorithm.kl.coef=0.05"]


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PPO (a learned critic, GAE, whitened advantages) in process (3 steps) and on 2 ranks
    (2 steps), with a separate value model and with a value head on the policy."""
    root = tmp_path_factory.mktemp("ppo")
    out = {}
    for placement in ("model", "head"):
        more = [*PPO, f"algorithm.critic.placement={placement}"]
        for name, steps, ranks in (("in_process", 3, 0), ("two", 2, 2)):
            out[f"{placement}_{name}"] = root / f"{placement}_{name}"
            train(config(steps, ranks, *more), out=out[f"{placement}_{name}"], progress=False)
    return out


@pytest.mark.parametrize("placement", ["model", "head"])
def test_ppo_on_two_ranks_gives_the_in_process_run_within_1e_5(
    ppo_runs: dict[str, Path], placement: str
) -> None:
    """The critic's values, GAE, the whole batch's whitening, the policy's and the
    critic's updates across two ranks: every metric, the critic's included, as in
    process."""
    got, expected = rows(ppo_runs[f"{placement}_two"]), rows(ppo_runs[f"{placement}_in_process"])
    assert_close(got, expected[:3])
    assert all(r["critic/value_loss"] > 0 for r in got[1:])  # the critic had something to fit
    assert got[2]["critic/value_mean"] != 0  # and its first step moved it off zero


def test_a_two_rank_ppo_checkpoint_resumes_in_process(
    ppo_runs: dict[str, Path], tmp_path: Path
) -> None:
    """The group's critic state (value model, head, optimizer) is the in-process layout:
    step 3 in process after the group's two is the in-process run's step 3 (a critic that
    was not restored would start again from zero values)."""
    run = tmp_path / "resumed"
    shutil.copytree(ppo_runs["model_two"], run)
    more = [*PPO, "algorithm.critic.placement=model"]
    result = train(config(3, 0, *more), out=run, resume=True, progress=False)
    diffs = differences(result.rows, rows(ppo_runs["model_in_process"])[3:])
    # Whitened advantages sum to zero: the policy loss is terms of size 1 cancelling to
    # about 1e-6, so its rounding is the terms' (measured 1.8e-6); every other metric
    # agrees within 1e-7 (measured), the critic's value and the gradient norm included.
    assert diffs.pop("loss/policy") < 1e-5
    assert max(diffs.values()) < 1e-6, diffs
    a = torch.load(run / "checkpoints" / "step_000002" / "extra.pt", weights_only=True)
    b = torch.load(
        ppo_runs["model_in_process"] / "checkpoints" / "step_000002" / "extra.pt",
        weights_only=True,
    )
    assert sorted(a["critic"]) == sorted(b["critic"]) == ["head", "optimizer", "trunk"]
    assert sorted(a["critic"]["optimizer"]["state"]) == sorted(b["critic"]["optimizer"]["state"])


@pytest.mark.parametrize("placement", ["model", "head"])
def test_ppo_beside_lora_on_two_ranks_gives_the_in_process_run(
    tmp_path: Path, placement: str
) -> None:
    """PPO's critic beside LoRA adapters on two ranks: a value head on the adapted policy,
    or a value model that starts as the driver's policy (its adapters included) and trains
    adapters of its own. Every metric, the critic's included, is the in-process run's
    within 1e-5; the group's checkpoint resumes in process into the in-process step 3."""
    more = [
        "model.lora.rank=4", "model.lora.alpha=8", *PPO,
        f"algorithm.critic.placement={placement}",
    ]  # fmt: skip
    out = {name: tmp_path / name for name in ("in_process", "two", "resumed")}
    train(config(3, 0, *more), out=out["in_process"], progress=False)
    train(config(2, 2, *more), out=out["two"], progress=False)
    expected = rows(out["in_process"])
    got = rows(out["two"])
    assert_close(got, expected[:3])
    assert all(r["critic/value_loss"] > 0 for r in got[1:])  # the critic had something to fit
    assert got[2]["critic/value_mean"] != 0  # and its first step moved it off zero
    shutil.copytree(out["two"], out["resumed"])
    resumed = train(config(3, 0, *more), out=out["resumed"], resume=True, progress=False)
    diffs = differences(resumed.rows, expected[3:])
    assert diffs.pop("loss/policy") < 1e-5  # terms of size 1 cancelling (see above)
    assert max(diffs.values()) < 1e-5, diffs


def test_the_loop_alone_does_not_ignore_learner_ranks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.learner_ranks = 2 runs through turnrl"):
        train_in_process(config(2, 2), tmp_path / "run", progress=False)


@pytest.fixture(autouse=True)
def _no_group_left_open() -> Iterator[None]:
    yield
    assert groups_alive() == []  # every run stops its ranks, however it ends


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_nccl_rank_on_the_gpu_gives_the_in_process_gpu_run(tmp_path: Path) -> None:
    """The driver's GPU path: the learner on one rank over NCCL, the torch sampler on the
    same GPU, against the in-process CUDA run of the same seed. CUDA kernels need not be
    bitwise repeatable, so the bound is the two-rank one."""
    on_gpu = "model.device=cuda"
    group = train(config(2, 1, on_gpu), out=tmp_path / "one", progress=False)
    alone = train(config(2, 0, on_gpu), out=tmp_path / "alone", progress=False)
    assert group.rows[0]["startup/logprob_gap_max"] < 1e-3
    assert_close(rows(tmp_path / "one"), rows(tmp_path / "alone"))
    assert "perf/weight_sync_s" in group.rows[1]
    assert alone.rows
