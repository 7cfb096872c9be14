"""Learner ranks as Ray actors (``cluster.learner_placement = "ray"``: ray_ranks.py) on a
local Ray cluster, against the ranks as local processes and the in-process learner: the
same update; a killed actor named with the call; a run with its ranks on Ray gives the run
with local ranks, bit for bit; the run's Ray cluster is shared with its rollout workers and
shut down after both."""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed")

from test_distributed_learner import (  # noqa: E402
    CONFIG,
    TEMPERATURE,
    advantages,
    batch,
    in_process,
    max_diff,
    samples,
)
from test_distributed_train import RUN, deterministic, rows  # noqa: E402
from turnrl.api import train  # noqa: E402
from turnrl.distributed import LearnerGroup, LearnerRankError, ray_cluster  # noqa: E402
from turnrl.errors import ConfigError  # noqa: E402
from turnrl.trainer.config import load_config  # noqa: E402

# First the tests that start (and stop) Ray themselves; then the module's cluster.


def test_a_run_with_its_ranks_on_ray_gives_the_run_with_local_ranks(tmp_path: Path) -> None:
    """Two steps with 2 learner ranks and 1 rollout worker, the ranks as processes of the
    driver and as Ray actors: the same metrics, bit for bit (the same shards, reductions
    and threads). The run starts its own Ray cluster for both and shuts it down when it
    ends."""
    assert not ray.is_initialized()
    got = {}
    for placement in ("local", "ray"):
        config = load_config(
            None,
            [*RUN, "steps=2", "threads=1", "cluster.learner_ranks=2",
             "cluster.rollout_workers=1", f"cluster.learner_placement={placement}"],
        )  # fmt: skip
        train(config, out=tmp_path / placement, progress=False)
        got[placement] = rows(tmp_path / placement)
        assert not ray.is_initialized()  # shut down with the run
    assert [r["step"] for r in got["ray"]] == [0, 1, 2]
    # the same processes' work, only started by Ray: bitwise the same
    assert [deterministic(r) for r in got["ray"]] == [deterministic(r) for r in got["local"]]


def test_placing_ranks_on_ray_needs_ranks() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.learner_ranks >= 1"):
        load_config(None, ["cluster.learner_placement=ray"])
    with pytest.raises(ConfigError, match=r"must be one of \['local', 'ray'\]"):
        load_config(None, ["cluster.learner_ranks=2", "cluster.learner_placement=slurm"])


def test_the_cluster_is_shut_down_by_the_last_to_leave() -> None:
    """Two members join a cluster the first one starts; it stays up until both have left."""
    assert not ray.is_initialized()
    ray_cluster.join(min_cpus=1)
    ray_cluster.join()
    ray_cluster.leave()
    assert ray.is_initialized()
    ray_cluster.leave()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray cluster for the module (the groups join it and leave it running)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def parent(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def gone_soon(pids: list[int], timeout_s: float = 10.0) -> bool:
    """Whether every process of ``pids`` has ended within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def test_ranks_on_ray_give_the_in_process_update(local_ray: None, tiny_model_dir: Path) -> None:
    """Two ranks as Ray actors (Ray's worker processes, not this process's children): the
    update of samples shared among them is the in-process learner's, and closing the
    group stops both actors."""
    reference = in_process(tiny_model_dir)
    s, adv = samples(7, seed=1), advantages(7)
    expected = reference.step_samples(s, adv, pad_id=0)
    with LearnerGroup(
        tiny_model_dir, CONFIG, num_ranks=2, temperature=TEMPERATURE, timeout_s=60,
        placement="ray",
    ) as group:  # fmt: skip
        pids = group.pids
        assert len(set(pids)) == 2
        assert all(parent(pid) != os.getpid() for pid in pids)  # Ray started them
        got = group.step_samples(s, adv, pad_id=0)
        weights = group.full_state_dict()
    assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
    assert got["loss/kl"] == pytest.approx(expected["loss/kl"], rel=1e-5, abs=1e-7)
    assert max_diff(weights, reference.model.state_dict()) < 1e-5
    assert gone_soon(pids)
    assert ray.is_initialized()  # the module's cluster: joined, not started, so left running


def test_a_group_dropped_without_close_stops_its_actors(
    local_ray: None, tiny_model_dir: Path
) -> None:
    group = LearnerGroup(
        tiny_model_dir, CONFIG, num_ranks=2, temperature=1.0, timeout_s=30, placement="ray"
    )
    pids = group.pids
    del group
    gc.collect()
    assert gone_soon(pids)
    assert ray.is_initialized()  # left, not shut down: the module's cluster


def test_a_killed_ray_rank_is_named_with_the_call(local_ray: None, tiny_model_dir: Path) -> None:
    group = LearnerGroup(
        tiny_model_dir, CONFIG, num_ranks=2, temperature=1.0, timeout_s=30, placement="ray"
    )
    pids = group.pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(LearnerRankError, match=r"rank 1 died \(its Ray actor died") as e:
        group.step(batch())
    assert "during step 1" in str(e.value)
    assert time.monotonic() - t0 < 30
    assert e.value.ranks == (1,)
    assert gone_soon(pids)  # the other rank is stopped too
