"""Rollout workers (``cluster.rollout_workers``) against the in-process run, end to end: real
Ray actors on a local Ray cluster, the small-run settings. One worker gives the in-process
metrics exactly; two agree with it up to float rounding; a worker killed mid-step is
replaced and its shard run again, so the run's episodes and metrics are those of a run
without the kill; a worker dead at a weight sync is replaced holding the new weights; a
hung worker stops the run naming it; asynchronous training collects
the same prompts on workers, overlapping batches run together on a worker and resume
exactly once; `turnrl train` joins a cluster started with `ray start`."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL_RUN
from turnrl.api import train
from turnrl.distributed import weight_broadcast
from turnrl.distributed.rollout_workers import (
    RayRolloutWorkers,
    RolloutWorker,
    RolloutWorkerError,
    chosen_weight_sync,
    contiguous_shards,
    worker_calls_at_once,
    worker_resources,
)
from turnrl.envs import make_env_family
from turnrl.errors import BackendError, ConfigError
from turnrl.rollout.groups import GroupSpec
from turnrl.trainer.config import Config, load_config, resolved
from turnrl.trainer.startup import WorkersSpec, episode_settings

ray = pytest.importorskip("ray")

Row = dict[str, Any]

RUN = [*SMALL_RUN, "steps=3", "threads=1", "algorithm.entropy_coef=0.05", "algorithm.lr=0.01"]
# Two workers batch each half of the episodes apart, so the engines' sums run over other
# paddings: float32 rounding in the sampler's log-probs (measured: 5e-9 in
# train/logprob_mismatch; the sampled tokens, rewards and updates are the same).
ABS = 1e-6


def config(workers: int, *more: str) -> Config:
    return load_config(None, [*RUN, f"cluster.rollout_workers={workers}", *more])


def rows(run_dir: Path) -> list[Row]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: Row) -> Row:
    """A row without wall-clock times, and without the workers' own counters."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith("perf/") and k not in ("warmup/s", "rollout/worker_restarts")
    }


def episodes(run_dir: Path) -> list[tuple[int, str, int, float]]:
    """(step, task, sample, reward) of every logged trajectory, in the order written."""
    lines = (run_dir / "trajectories.jsonl").read_text().splitlines()
    return [
        (t["step"], t["task_id"], t["sample_index"], t["reward"]) for t in map(json.loads, lines)
    ]


def test_the_workers_of_a_cluster_it_starts_run_at_the_driver_s_priority(
    model: Any, tokenizer: Any, tiny_model_dir: Path
) -> None:
    """Ray starts its workers 15 niceness levels below the driver, where a learner update
    beside them (asynchronous training) would leave them a sliver of a core; the local
    cluster the workers start runs them at the driver's priority. (First in the module:
    the module's shared cluster is not up yet.)"""
    assert not ray.is_initialized()
    c = resolved(config(1))
    family = make_env_family(c.env.name, **c.env.options)
    workers = RayRolloutWorkers(WorkersSpec(c, family, model, tokenizer, 0, tiny_model_dir), 1)
    try:
        call = workers.actors[0].__ray_call__.remote(lambda actor: os.nice(0))
        niceness = ray.get(call, timeout=60)
    finally:
        workers.close()
    assert niceness == os.nice(0)
    assert not ray.is_initialized()  # the cluster it started is stopped


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray cluster for the module's runs (the workers join it; each run starting
    its own is the command-line test's case)."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, local_ray: None) -> dict[str, Path]:
    """The same run in process, on one worker and on two, and on one worker synced by
    broadcast."""
    base = tmp_path_factory.mktemp("workers")
    out = {}
    for name, workers, *more in (
        ("in_process", 0),
        ("one", 1),
        ("two", 2),
        ("object_store", 1, OBJECT_STORE),
    ):
        out[name] = base / name
        train(config(workers, *more), out=out[name], progress=False)
    return out


BROADCAST = "cluster.weight_sync=broadcast"
OBJECT_STORE = "cluster.weight_sync=object_store"


def test_one_worker_gives_the_in_process_run(runs: dict[str, Path]) -> None:
    expected, got = rows(runs["in_process"]), rows(runs["one"])
    assert [deterministic(r) for r in got] == [deterministic(r) for r in expected]
    assert episodes(runs["one"]) == episodes(runs["in_process"])
    assert all(r["perf/rollout_sync_s"] > 0 for r in got[1:])  # a sync after every update
    assert [r["rollout/worker_restarts"] for r in got[1:]] == [0.0, 0.0, 0.0]


def test_one_worker_synced_through_the_object_store_gives_the_in_process_run(
    runs: dict[str, Path],
) -> None:
    expected, got = rows(runs["in_process"]), rows(runs["object_store"])
    assert [deterministic(r) for r in got] == [deterministic(r) for r in expected]
    assert episodes(runs["object_store"]) == episodes(runs["in_process"])
    assert all(r["perf/rollout_sync_s"] > 0 for r in got[1:])


def test_the_weight_sync_is_the_broadcast_on_a_cpu_and_the_object_store_on_a_gpu() -> None:
    assert chosen_weight_sync("auto", "cpu") == "broadcast"
    assert chosen_weight_sync("auto", "cuda") == "object_store"
    for setting in ("object_store", "broadcast"):
        assert chosen_weight_sync(setting, "cpu") == chosen_weight_sync(setting, "cuda") == setting
    with pytest.raises(ValueError, match="weight_sync must be auto, object_store or broadcast"):
        chosen_weight_sync("nccl", "cpu")


def test_two_workers_agree_with_the_in_process_run(runs: dict[str, Path]) -> None:
    expected, got = rows(runs["in_process"]), rows(runs["two"])
    assert episodes(runs["two"]) == episodes(runs["in_process"])  # the same samples
    for g, e in zip(got, expected, strict=True):
        assert deterministic(g).keys() == deterministic(e).keys()
        for key, value in deterministic(e).items():
            assert g[key] == pytest.approx(value, abs=ABS), (g["step"], key)


class Tripwire:
    """The small run's environment family, whose environments do something bad when a
    file exists: ``kill`` (the first reset to find it, claimed by renaming, kills its own
    process: one worker dies mid-step, its other episodes in flight; ``kill-in-step``: the
    first step does), ``hang`` (every reset sleeps a minute) or ``slow`` (every reset and
    every step wait half a second, letting others run)."""

    def __init__(self, directory: Path, settings: Config | None = None) -> None:
        env = (settings or config(0)).env  # the small run's unless ``settings`` are given
        self.inner = make_env_family(env.name, **env.options)
        self.directory = str(directory)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":  # unpickling asks before inner is set
            raise AttributeError(name)
        return getattr(self.inner, name)

    def task(self, index: int, split: str = "train") -> Any:
        return self.inner.task(index, split)

    def make_env(self) -> Any:
        return TripwireEnv(self.inner.make_env(), self.directory)


class TripwireEnv:
    def __init__(self, env: Any, directory: str) -> None:
        self.env = env
        self.directory = directory

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    async def reset(self, task: Any, seed: int) -> Any:
        self._trip("kill")
        if os.path.exists(os.path.join(self.directory, "hang")):
            time.sleep(60)
        await self._slow()
        return await self.env.reset(task, seed)

    async def step(self, action: str) -> Any:
        self._trip("kill-in-step")
        await self._slow()
        return await self.env.step(action)

    def _trip(self, name: str) -> None:
        """Kill this process if the file ``name`` exists and this is the first to claim it."""
        kill = os.path.join(self.directory, name)
        try:
            os.rename(kill, kill + ".fired")
        except FileNotFoundError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    async def _slow(self) -> None:
        if os.path.exists(os.path.join(self.directory, "slow")):
            await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
def by_value() -> None:
    """Ray workers import this test module's classes from the pickles (not importable there)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("sync", ["object_store", "broadcast"])
def test_a_worker_killed_mid_step_loses_no_episode(
    runs: dict[str, Path], tmp_path: Path, by_value: None, sync: str
) -> None:
    """Killed at the start of step 2's rollout, worker 0 or 1 is replaced and its shard
    collected again: every step has the episodes, and the metrics, of the run without the
    kill (``runs["two"]``), and the restart is counted at step 2. With the broadcast, the
    replacement loads the driver's weights through the object store, and the next sync
    forms the group again."""
    family = Tripwire(tmp_path)

    def arm(row: Row) -> None:
        if row["step"] == 1:
            (tmp_path / "kill").write_text("")

    out = tmp_path / "run"
    train(config(2, f"cluster.weight_sync={sync}"), env=family, out=out, progress=False, on_row=arm)
    assert (tmp_path / "kill.fired").exists()  # a worker did die
    got = rows(out)
    assert [r.get("rollout/worker_restarts") for r in got] == [None, 0.0, 1.0, 0.0]
    assert episodes(out) == episodes(runs["two"])
    assert [deterministic(r) for r in got] == [deterministic(r) for r in rows(runs["two"])]


@pytest.fixture(scope="module")
def ranks_runs(tmp_path_factory: pytest.TempPathFactory, local_ray: None) -> dict[str, Path]:
    """Two workers and two learner ranks: synced by broadcast (the ranks send to the
    workers themselves), and through the object store (through the driver's model)."""
    base = tmp_path_factory.mktemp("ranks")
    out = {}
    for name, sync in (("direct", BROADCAST), ("driver", OBJECT_STORE)):
        out[name] = base / name
        settings = (2, sync, "cluster.learner_ranks=2", "save_every=2")
        train(config(*settings), out=out[name], progress=False)
    return out


def test_the_learner_s_ranks_send_the_weights_to_the_workers_themselves(
    ranks_runs: dict[str, Path],
) -> None:
    """With the broadcast the ranks send each update's weights to the workers, the driver
    only coordinating: no gather into the driver's model (no ``perf/weight_sync_s``), and
    the run is the one synced through the driver's model exactly (every metric, every
    episode); the checkpoints, which bring the driver's model up to date first, hold the
    same weights."""
    direct, driver = rows(ranks_runs["direct"]), rows(ranks_runs["driver"])
    assert [deterministic(r) for r in direct] == [deterministic(r) for r in driver]
    assert episodes(ranks_runs["direct"]) == episodes(ranks_runs["driver"])
    assert all("perf/weight_sync_s" not in r and r["perf/rollout_sync_s"] > 0 for r in direct[1:])
    assert all(r["perf/weight_sync_s"] > 0 for r in driver[1:])
    for step in ("step_000002", "step_000003"):
        a, b = (load_file(ranks_runs[k] / "checkpoints" / step / "model" / "model.safetensors")
                for k in ("direct", "driver"))  # fmt: skip
        assert a.keys() == b.keys(), step
        assert all(torch.equal(a[k], b[k]) for k in a), step


def test_a_worker_killed_mid_step_while_the_ranks_send_loses_no_episode(
    ranks_runs: dict[str, Path], tmp_path: Path, by_value: None
) -> None:
    """Killed at the start of step 2's rollout, a worker is replaced from the driver's
    model brought up to date from the ranks (it lags them), its shard collected again, and
    the next sync forms the group again with rank 0: the run without the kill, exactly."""
    family = Tripwire(tmp_path)

    def arm(row: Row) -> None:
        if row["step"] == 1:
            (tmp_path / "kill").write_text("")

    out = tmp_path / "run"
    c = config(2, BROADCAST, "cluster.learner_ranks=2", "save_every=2")
    train(c, env=family, out=out, progress=False, on_row=arm)
    assert (tmp_path / "kill.fired").exists()
    got = rows(out)
    assert [r.get("rollout/worker_restarts") for r in got] == [None, 0.0, 1.0, 0.0]
    assert episodes(out) == episodes(ranks_runs["direct"])
    assert [deterministic(r) for r in got] == [deterministic(r) for r in rows(ranks_runs["direct"])]


ASYNC_RANKS = ("cluster.learner_ranks=2", "save_every=2", "algorithm.max_staleness=1")


def test_an_asynchronous_run_s_ranks_send_to_the_workers_and_a_replacement_loses_nothing(
    local_ray: None, tmp_path: Path, by_value: None
) -> None:
    """One step deep (``max_staleness = 1``) the ranks send each sync to the workers too
    (no ``perf/weight_sync_s``: the driver's model is not brought up to date after each
    update), and the run is the one synced through the driver's model exactly, its
    checkpoints included. A worker killed at the start of a batch, which samples while the
    ranks run the next update, is replaced from the sync rank 0 kept: the same episodes
    and metrics again."""
    direct, driver, killed = tmp_path / "direct", tmp_path / "driver", tmp_path / "killed"
    train(config(2, BROADCAST, *ASYNC_RANKS), out=direct, progress=False)
    train(config(2, OBJECT_STORE, *ASYNC_RANKS), out=driver, progress=False)
    got, expected = rows(direct), rows(driver)
    assert [deterministic(r) for r in got] == [deterministic(r) for r in expected]
    assert episodes(direct) == episodes(driver)
    assert all(r["rollout/staleness_1"] == 1.0 for r in got[2:])
    assert all("perf/weight_sync_s" not in r for r in got[1:])
    assert sum(r["perf/rollout_sync_s"] > 0 for r in got[1:]) >= 2
    assert all(r["perf/weight_sync_s"] > 0 for r in expected[1:])
    for step in ("step_000002", "step_000003"):
        a, b = (load_file(out / "checkpoints" / step / "model" / "model.safetensors")
                for out in (direct, driver))  # fmt: skip
        assert a.keys() == b.keys(), step
        assert all(torch.equal(a[k], b[k]) for k in a), step

    family = Tripwire(tmp_path)

    def arm(row: Row) -> None:
        if row["step"] == 1:  # a batch that starts from now on: step 3's, or step 2's
            (tmp_path / "kill").write_text("")

    train(config(2, BROADCAST, *ASYNC_RANKS), env=family, out=killed, progress=False, on_row=arm)
    assert (tmp_path / "kill.fired").exists()
    assert sum(r.get("rollout/worker_restarts", 0.0) for r in rows(killed)) == 1.0
    assert episodes(killed) == episodes(direct)
    assert [deterministic(r) for r in rows(killed)] == [deterministic(r) for r in got]


def test_a_worker_killed_mid_step_of_a_run_with_partial_rollouts_loses_no_episode(
    local_ray: None, tmp_path: Path, by_value: None
) -> None:
    """With partial rollouts (offers to the workers while they sample), a worker killed at
    the start of step 3's rollout is replaced from the newest offered weights and its shard
    collected again: every step trains on the episodes of the run without the kill."""
    from test_async import PARTIAL, turn_versions_move_forward

    settings = [*PARTIAL, "cluster.rollout_workers=2", "algorithm.partial_rollouts=true"]
    straight = tmp_path / "straight"
    train(load_config(None, settings), out=straight, progress=False)

    def arm(row: Row) -> None:
        if row["step"] == 1:  # step 2's batch is being collected: the kill hits step 3's
            (tmp_path / "kill").write_text("")

    out = tmp_path / "run"
    c = load_config(None, settings)
    train(c, env=Tripwire(tmp_path, c), out=out, progress=False, on_row=arm)
    assert (tmp_path / "kill.fired").exists()  # a worker did die
    assert sum(r.get("rollout/worker_restarts", 0.0) for r in rows(out)) == 1.0
    ids = [(step, task, sample) for step, task, sample, _ in episodes(out)]
    assert ids == [(step, task, sample) for step, task, sample, _ in episodes(straight)]
    turn_versions_move_forward(out)


def test_a_hung_worker_stops_the_run_naming_it(
    tmp_path: Path, local_ray: None, by_value: None
) -> None:
    armed: list[float] = []

    def arm(row: Row) -> None:  # after the start-up checks, which reset environments here
        if row["step"] == 0:
            (tmp_path / "hang").write_text("")
            armed.append(time.monotonic())

    # The deadline holds for every call, the start-up's too: 10 s, not less, so that a
    # loaded machine's start-up (which once took over 3 s under `make test`) stays within it.
    with pytest.raises(
        RolloutWorkerError, match=r"rollout worker\(s\) 0, 1 did not return .* 10 s"
    ):
        train(
            config(2, "cluster.worker_timeout_s=10"), env=Tripwire(tmp_path),
            out=tmp_path / "run", progress=False, on_row=arm,
        )  # fmt: skip
    assert armed, "the deadline struck during the start-up, before the hang was armed"
    # From the hang to the error: the 10 s deadline, not the minute the environments sleep
    # (the run's start before it is not timed: it is slow on a loaded machine).
    assert time.monotonic() - armed[0] < 30


def sampled_turns(groups: Any) -> list[tuple[Any, ...]]:
    """(task, completion tokens, policy version) of every turn of ``groups``."""
    return [
        (t.task_id, turn.completion_ids, turn.policy_version)
        for group in groups for t in group for turn in t.turns
    ]  # fmt: skip


def updated(model: Any) -> None:
    """An update: weights the workers must sample with after the next sync."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))


def sampled_as_in_process(
    workers: RayRolloutWorkers, c: Config, family: Any, policy: Any, tokenizer: Any, version: int
) -> None:
    """The workers' episodes equal those of a worker in this process holding ``policy``
    as ``version``: the same tokens, every turn recorded as ``version``."""
    sampling, limits = episode_settings(c, tokenizer)
    spec = GroupSpec(2, limits, sampling, seed=3, policy_version=version)
    tasks = [family.task(i) for i in range(4)]
    got = asyncio.run(workers.collect(tasks, spec))
    local = RolloutWorker(c, family, policy, tokenizer, version, threads=1)
    expected = local.collect(tasks, spec)

    assert sampled_turns(got) == sampled_turns(expected)
    assert {v for *_, v in sampled_turns(got)} == {version}


def kill_worker_1(workers: RayRolloutWorkers, model: Any, when: str) -> list[int]:
    """Worker 1 killed now (``when = "before"`` the next sync), or set to die in the
    middle of the next broadcast (``"during"``: a first sync of ``model`` forms the group);
    the workers' process ids before."""
    pids = ray.get([a.pid.remote() for a in workers.actors], timeout=60)
    if when == "during":
        workers.sync(model, 1)  # the group is formed
        ray.get(workers.actors[1].__ray_call__.remote(dies_in_the_broadcast), timeout=60)
    else:
        os.kill(pids[1], signal.SIGKILL)
    return list(pids)


def dies_in_the_broadcast(worker: Any) -> None:
    """Run in a worker (``__ray_call__``): its process exits at the second collective of
    the next broadcast (one per tensor: the test sets the buckets' size to 1 byte), as a
    worker killed mid-sync."""
    group = worker._receiver._group
    calls = []

    class Dying:
        def broadcast(self, *args: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                os._exit(9)
            return group.broadcast(*args)

    worker._receiver._group = Dying()


@pytest.mark.parametrize(
    ("sync", "when"),
    [("object_store", "before"), ("broadcast", "before"), ("broadcast", "during")],
)
def test_a_worker_dead_at_the_sync_is_replaced_holding_the_new_weights(
    local_ray: None, model: Any, tokenizer: Any, tiny_model_dir: Path, by_value: None,
    sync: str, when: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Worker 1's process is killed before a weight sync (or, with the broadcast, in the
    middle of one): the sync replaces it (counted), and both workers then sample with the
    synced weights and version, exactly as a worker in this process holding them does.
    Killed during a broadcast, it leaves worker 0 blocked in the collective: worker 0 is
    replaced too, and the sync sent again to both."""
    monkeypatch.setattr(weight_broadcast, "BUCKET_BYTES", 1)  # each tensor a collective
    c = resolved(config(2, f"cluster.weight_sync={sync}"))
    family = make_env_family(c.env.name, **c.env.options)
    workers = RayRolloutWorkers(
        WorkersSpec(c, family, model, tokenizer, 0, tiny_model_dir), 2, threads=1,
        weight_sync=sync,
    )  # fmt: skip
    try:
        pids = kill_worker_1(workers, model, when)
        updated(model)
        workers.sync(model, 7)
        restarts = 2 if when == "during" else 1
        assert workers.take_metrics() == {"rollout/worker_restarts": float(restarts)}
        now = ray.get([a.pid.remote() for a in workers.actors], timeout=60)
        assert sum(pid not in pids for pid in now) == restarts
        sampled_as_in_process(workers, c, family, copy.deepcopy(model), tokenizer, 7)
    finally:
        workers.close()


def ranks_and_workers(
    c: Config, family: Any, model_dir: Path, driver_model: Any, tokenizer: Any, source: Any = None
) -> tuple[Any, Any, RayRolloutWorkers]:
    """One learner rank (built from ``source``, else ``model_dir``) driven by a
    ``GroupLearner`` whose model lags the ranks' (``driver_model``), and two workers synced
    by broadcast; the caller closes the group and the workers."""
    from turnrl.distributed import LearnerGroup
    from turnrl.distributed.driver import GroupLearner

    source = model_dir if source is None else source
    group = LearnerGroup(source, c.algorithm, num_ranks=1, temperature=1.0, timeout_s=120)
    learner = GroupLearner(group, driver_model)
    learner.model_lags = True
    workers = RayRolloutWorkers(
        WorkersSpec(c, family, driver_model, tokenizer, 0, model_dir), 2, threads=1,
        weight_sync="broadcast",
    )  # fmt: skip
    return group, learner, workers


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_worker_dead_at_a_sync_from_the_ranks_is_replaced_holding_the_new_weights(
    local_ray: None, model: Any, tokenizer: Any, tiny_model_dir: Path, by_value: None,
    when: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The learner's rank 0 sends (ranks_to_workers.py), and worker 1 is killed before a
    sync, or in the middle of one (rank 0's broadcast then fails, and worker 0 is left
    blocked): the workers that did not finish are replaced, rank 0 joins the group formed
    again, and sends again; both workers then sample with the ranks' new weights, which the
    driver's model had not seen."""
    from test_distributed_learner import advantages, samples

    monkeypatch.setattr(weight_broadcast, "BUCKET_BYTES", 1)  # each tensor a collective
    c = resolved(config(2, BROADCAST, "cluster.learner_ranks=1"))
    family = make_env_family(c.env.name, **c.env.options)
    driver_model = copy.deepcopy(model)
    group, learner, workers = ranks_and_workers(c, family, tiny_model_dir, driver_model, tokenizer)
    try:
        workers.send_from_ranks(learner)
        pids = kill_worker_1(workers, driver_model, when)
        before = copy.deepcopy(driver_model.state_dict())
        learner.step_samples(samples(6, seed=2), advantages(6), pad_id=0)  # the ranks only
        assert all(torch.equal(v, before[k]) for k, v in driver_model.state_dict().items())
        policy = copy.deepcopy(driver_model)
        policy.load_state_dict(group.full_state_dict())
        workers.sync(driver_model, 7)
        restarts = 2 if when == "during" else 1
        assert workers.take_metrics() == {"rollout/worker_restarts": float(restarts)}
        now = ray.get([a.pid.remote() for a in workers.actors], timeout=60)
        assert sum(pid not in pids for pid in now) == restarts
        sampled_as_in_process(workers, c, family, policy, tokenizer, 7)
    finally:
        workers.close()
        group.close()


@pytest.mark.parametrize("lora", [False, True], ids=["whole", "lora"])
def test_a_worker_replaced_while_the_ranks_update_starts_from_the_sync_rank_0_kept(
    local_ray: None, model: Any, tokenizer: Any, tiny_model_dir: Path, lora: bool
) -> None:
    """An asynchronous run's sync from the ranks (``max_staleness = 1``): rank 0 keeps
    what it sent. Worker 1 is killed while the ranks run the next update; its
    replacement, asking for its start weights in the middle of that update, gets them
    once the update returns, and they are the sync's, not the ranks' newer weights: both
    workers sample as a worker in this process holding the synced policy (a LoRA one
    merged from the base rank 0 kept and the adapters of the sync)."""
    import concurrent.futures
    import functools

    from test_distributed_learner import LORA as ADAPTED
    from test_distributed_learner import advantages, lora_driver, samples
    from turnrl.distributed import with_adapters
    from turnrl.distributed.rollout_workers import cpu_weights
    from turnrl.models import load_model

    c = resolved(config(2, BROADCAST, "cluster.learner_ranks=1", "algorithm.max_staleness=1"))
    family = make_env_family(c.env.name, **c.env.options)
    source: Any = tiny_model_dir
    driver_model = copy.deepcopy(model)
    if lora:
        source = functools.partial(
            with_adapters, functools.partial(load_model, tiny_model_dir), **ADAPTED
        )
        driver_model = lora_driver(tiny_model_dir, seed=0)
    group, learner, workers = ranks_and_workers(
        c, family, tiny_model_dir, driver_model, tokenizer, source
    )
    updating = concurrent.futures.ThreadPoolExecutor(1)
    try:
        group.load_weights(driver_model.state_dict())
        workers.send_from_ranks(learner, keep=True)
        learner.step_samples(samples(6, seed=2), advantages(6), pad_id=0)
        workers.sync(driver_model, 7)  # rank 0 sends the update's weights, and keeps them
        synced = copy.deepcopy(driver_model)
        synced.load_state_dict(group.full_state_dict())
        policy = load_model(tiny_model_dir)  # what a worker samples: a LoRA policy merged
        policy.load_state_dict(cpu_weights(synced))
        pid = ray.get(workers.actors[1].pid.remote(), timeout=60)
        update = updating.submit(
            learner.step_samples, samples(6, seed=3), advantages(6), pad_id=0
        )  # the next update, while the workers sample version 7
        os.kill(pid, signal.SIGKILL)
        sampled_as_in_process(workers, c, family, policy, tokenizer, 7)
        update.result(timeout=120)
        assert workers.take_metrics() == {"rollout/worker_restarts": 1.0}
        synced.load_state_dict(group.full_state_dict())  # the ranks' weights now
        newer = cpu_weights(synced)
        assert max(float((newer[k] - v).abs().max()) for k, v in policy.state_dict().items()) > 0
    finally:
        updating.shutdown()
        workers.close()
        group.close()


def test_workers_that_cannot_reach_the_driver_s_store_stop_the_sync_saying_so(
    local_ray: None, model: Any, tokenizer: Any, tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The driver's store advertised at an address the workers cannot reach (TEST-NET-1,
    as a firewalled driver node): the first sync stops within the join deadline, naming
    the address and what to do, and restarts no worker (they are not the problem)."""
    c = resolved(config(2, BROADCAST))
    family = make_env_family(c.env.name, **c.env.options)
    workers = RayRolloutWorkers(
        WorkersSpec(c, family, model, tokenizer, 0, tiny_model_dir), 2, threads=1,
        weight_sync="broadcast", join_timeout_s=3.0,
    )  # fmt: skip
    try:
        monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.1")
        started = time.monotonic()
        with pytest.raises(
            RolloutWorkerError,
            match=r"none could join the weight broadcast group at the driver's store "
            r"192\.0\.2\.1:\d+: every worker node must reach the driver's node",
        ):
            workers.sync(model, 1)
        assert time.monotonic() - started < 30
        assert workers.take_metrics() == {"rollout/worker_restarts": 0.0}
    finally:
        workers.close()


def test_a_worker_replaced_mid_batch_of_an_asynchronous_run_holds_the_synced_weights(
    local_ray: None, model: Any, tokenizer: Any, tiny_model_dir: Path
) -> None:
    """With the broadcast in an asynchronous run, the driver's model changes (the next
    update) while the workers sample: a worker replaced then loads the weights of the last
    sync, which the driver keeps a copy of, not the model's newer ones."""
    c = resolved(config(2, BROADCAST, "algorithm.max_staleness=1"))
    family = make_env_family(c.env.name, **c.env.options)
    workers = RayRolloutWorkers(
        WorkersSpec(c, family, model, tokenizer, 0, tiny_model_dir), 2, threads=1,
        weight_sync="broadcast",
    )  # fmt: skip
    try:
        updated(model)
        workers.sync(model, 7)
        synced = copy.deepcopy(model)
        updated(model)  # the learner's next update, while the workers sample version 7
        pid = ray.get(workers.actors[1].pid.remote(), timeout=60)
        os.kill(pid, signal.SIGKILL)
        sampled_as_in_process(workers, c, family, synced, tokenizer, 7)
        assert workers.take_metrics() == {"rollout/worker_restarts": 1.0}
    finally:
        workers.close()


OVERLAP = ["algorithm.max_staleness=2", "algorithm.partial_rollouts=true",
           "algorithm.overlap_batches=true"]  # fmt: skip


def test_batches_collected_at_once_run_together_on_a_worker_replaced_once_if_it_dies(
    local_ray: None, model: Any, tokenizer: Any, tiny_model_dir: Path, tmp_path: Path,
    by_value: None,
) -> None:  # fmt: skip
    """Overlapping batches: two batches collected at once on one worker run together on
    its engine (the actor takes both calls), and give the episodes each gives alone in
    this process. The worker killed while it holds both is replaced once, not once per
    batch, and both batches are collected again with the same episodes."""
    c = resolved(config(1, *OVERLAP))
    family = Tripwire(tmp_path, c)
    workers = RayRolloutWorkers(
        WorkersSpec(c, family, model, tokenizer, 0, tiny_model_dir), 1, threads=1
    )
    sampling, limits = episode_settings(c, tokenizer)
    batches = [
        ([family.task(i) for i in range(4 * b, 4 * b + 4)], GroupSpec(2, limits, sampling, seed=b))
        for b in range(2)
    ]

    async def both() -> list[Any]:
        return list(await asyncio.gather(*(workers.collect(*batch) for batch in batches)))

    (tmp_path / "slow").touch()  # each batch's episodes wait a while: the other comes
    try:
        together = asyncio.run(both())
        most = workers.actors[0].__ray_call__.remote(lambda w: w.programs.most_at_once)
        assert ray.get(most, timeout=60) == 2
        (tmp_path / "kill").touch()
        again = asyncio.run(both())
        assert (tmp_path / "kill.fired").exists()
        assert workers.take_metrics() == {"rollout/worker_restarts": 1.0}
    finally:
        workers.close()
    local = RolloutWorker(c, family, model, tokenizer, 0, threads=1)
    alone = [sampled_turns(local.collect(*batch)) for batch in batches]
    assert [sampled_turns(g) for g in together] == alone
    assert [sampled_turns(g) for g in again] == alone


def test_a_worker_takes_as_many_calls_at_once_as_it_may_sample_batches() -> None:
    """One batch at a time, one more call with partial rollouts (the offers), and up to
    max_staleness batches with overlapping batches."""
    assert worker_calls_at_once(config(1)) == 1
    assert worker_calls_at_once(config(1, "algorithm.max_staleness=1",
                                       "algorithm.partial_rollouts=true")) == 2  # fmt: skip
    assert worker_calls_at_once(config(1, *OVERLAP)) == 3
    assert worker_calls_at_once(config(1, *OVERLAP, "algorithm.max_staleness=4")) == 5
    assert worker_calls_at_once(config(1, *OVERLAP, "algorithm.max_staleness=1")) == 2  # inert


def test_overlapping_batches_on_workers_stay_within_the_bound_on_the_task_stream(
    local_ray: None, tmp_path: Path
) -> None:
    """k = 2 with partial rollouts and overlapping batches on two workers, episodes of two
    turns with a 500 ms lookup between them: a batch queued while the one before it waits
    on its lookups goes out to the workers at once. Every trajectory within the bound,
    turn versions never go back, the workers took the offers (nothing for the driver's own
    engine to do), and every step trains on its prompts of the task stream, each sample
    once."""
    from test_async import PARTIAL

    overlap_on_workers(tmp_path / "run", [*PARTIAL, "cluster.rollout_workers=2"])


def overlap_on_workers(out: Path, settings: list[str]) -> None:
    """Train ``settings`` with k = 2, partial rollouts and overlapping batches, six steps,
    into ``out``; check the bound, the turn versions, the offers and the task stream."""
    from test_async import samples_seen, turn_versions_move_forward

    c = load_config(None, [*settings, "steps=6", "eval.every=6", "log_groups=4", *OVERLAP])
    train(c, out=out, progress=False)
    steps = [r for r in rows(out) if r["step"] >= 2]
    assert max(r["rollout/batches_at_once"] for r in steps) == 2.0
    for r in steps:
        assert sum(r[f"rollout/staleness_{d}"] for d in range(3)) == pytest.approx(1.0)
        assert r["rollout/policy_lag_max"] <= 2.0
        assert "rollout/mid_batch_syncs" not in r
    assert all(r["perf/rollout_offer_s"] > 0 for r in steps[:-1])
    assert turn_versions_move_forward(out, k=2) > 0
    assert samples_seen(out) == task_stream(c)


def task_stream(c: Config) -> Counter[tuple[int, str, int]]:
    """Each (step, task, sample) of ``c``'s run once: the task stream's prompts of each
    step, ``rollout.group_size`` samples each."""
    family = make_env_family(c.env.name, **c.env.options)
    per_step, group = c.rollout.prompts_per_step, c.rollout.group_size
    return Counter(
        (s, family.task((s - 1) * per_step + j).id, i)
        for s in range(1, c.steps + 1) for j in range(per_step) for i in range(group)
    )  # fmt: skip


def test_a_worker_killed_under_overlapping_batches_loses_no_episode(
    local_ray: None, tmp_path: Path, by_value: None
) -> None:
    """Two workers, k = 2 with overlapping batches and every reset and step waiting half a
    second: the two batches queued at the first step run together on both workers, and
    one worker is killed at an episode's step, holding shards of both. It is replaced
    once, not once per batch, and every sample of the task stream is trained on exactly
    once."""
    from test_async import samples_seen

    c = config(2, "steps=4", "eval.every=4", "log_groups=2", *OVERLAP)
    (tmp_path / "slow").touch()

    def arm(row: Row) -> None:
        if row["step"] == 1:  # steps 2 and 3's batches are waiting on their resets
            (tmp_path / "kill-in-step").write_text("")

    out = tmp_path / "run"
    train(c, env=Tripwire(tmp_path, c), out=out, progress=False, on_row=arm)
    assert (tmp_path / "kill-in-step.fired").exists()  # a worker did die
    got = rows(out)
    assert sum(r.get("rollout/worker_restarts", 0.0) for r in got) == 1.0
    assert max(r.get("rollout/batches_at_once", 0.0) for r in got) == 2.0
    assert samples_seen(out) == task_stream(c)


def test_overlapping_batches_on_workers_resumed_after_a_crash_see_every_prompt_once(
    local_ray: None, tmp_path: Path
) -> None:
    """Two workers, k = 2 with overlapping batches: a crash after step 3 loses the batch
    collected ahead (and the checkpoint is step 2's); the resumed run collects steps 3
    and 4 again, so every sample of the task stream is trained on exactly once."""
    from test_async import samples_seen

    c = config(2, "steps=4", "eval.every=2", "save_every=2", "log_groups=2", *OVERLAP)
    out = tmp_path / "run"

    def crash_after_step_3(row: Row) -> None:
        if row["step"] == 3:  # step 4's batch is out on the workers: lost with the crash
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(c, out=out, progress=False, on_row=crash_after_step_3)
    train(c, out=out, resume=True, progress=False)
    assert samples_seen(out) == task_stream(c)
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3, 4]


def test_workers_take_offered_weights_and_a_replacement_starts_from_them(
    local_ray: None, model: Any, tokenizer: Any, tiny_model_dir: Path
) -> None:
    """Partial rollouts: weights offered between batches are taken before the next batch's
    first turn, by every worker; a worker that dies after an offer is replaced from the
    offered weights, and the next offers go to its replacement."""
    c = resolved(config(2, "algorithm.max_staleness=1", "algorithm.partial_rollouts=true"))
    family = make_env_family(c.env.name, **c.env.options)
    workers = RayRolloutWorkers(
        WorkersSpec(c, family, model, tokenizer, 0, tiny_model_dir), 2, threads=1
    )
    try:
        for version, kill in ((7, False), (8, True)):
            updated(model)
            assert workers.offer(model, version)["perf/rollout_offer_s"] > 0
            offered = copy.deepcopy(model)
            # an offer may run beside a batch (the actor takes two calls at once): wait for
            # these, so that the batch below starts after them
            ray.wait([call for call, *_ in workers._offers], num_returns=2, timeout=60)
            updated(model)  # the learner moves on: only the offered weights may sample
            if kill:
                os.kill(ray.get(workers.actors[1].pid.remote(), timeout=60), signal.SIGKILL)
            sampled_as_in_process(workers, c, family, offered, tokenizer, version)
        assert workers.take_metrics() == {"rollout/worker_restarts": 1.0}
        workers.offer(model, 9)
        ray.wait([call for call, *_ in workers._offers], num_returns=2, timeout=60)
        workers.offer(model, 10)  # sees the answers through: none failed
        assert len(workers._offers) == 2
    finally:
        workers.close()


def test_asynchronous_training_on_workers_collects_the_same_prompts(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """One version stale on two workers: each step trains on exactly the prompts (and
    samples) of the synchronous run, sampled one version behind the learner."""
    out = tmp_path / "run"
    train(config(2, "algorithm.max_staleness=1"), out=out, progress=False)
    got = rows(out)
    assert [r["rollout/staleness_1"] for r in got[1:]] == [0.0, 1.0, 1.0]
    ids = [(step, task, sample) for step, task, sample, _ in episodes(out)]
    assert ids == [(step, task, sample) for step, task, sample, _ in episodes(runs["two"])]


def test_two_steps_deep_on_workers_the_background_thread_syncs_them(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """max_staleness 2 on two workers: batches queued while the workers sample earlier
    ones are synced (broadcast) from the background thread; the same prompts and samples
    as the synchronous run, none more than 2 versions behind the learner."""
    out = tmp_path / "run"
    train(config(2, "algorithm.max_staleness=2"), out=out, progress=False)
    got = rows(out)
    assert [r["rollout/staleness_0"] for r in got[1:3]] == [1.0, 0.0]
    assert got[2]["rollout/staleness_1"] == 1.0  # queued at the first step, on its weights
    assert all(r["rollout/policy_lag_max"] <= 2.0 for r in got[1:])
    for x in map(json.loads, (out / "trajectories.jsonl").read_text().splitlines()):
        versions = {turn["policy_version"] for turn in x["turns"]}  # step s: learner's s - 1
        assert versions == {x["policy_version"]}
        assert 0 <= x["step"] - 1 - x["policy_version"] <= 2
    ids = [(step, task, sample) for step, task, sample, _ in episodes(out)]
    assert ids == [(step, task, sample) for step, task, sample, _ in episodes(runs["two"])]


def test_partial_rollouts_on_workers_take_the_offered_weights_between_turns(
    local_ray: None, tmp_path: Path
) -> None:
    """Two workers, two-turn episodes with a 500 ms lookup between the turns: after each
    update the driver offers the learner's weights, and each worker's engine takes them
    before its episodes' next turns (or before its next batch, where the offer came
    first); the syncs between batches then have nothing to do."""
    from test_async import PARTIAL

    partial_on_workers(tmp_path / "run", [*PARTIAL, "cluster.rollout_workers=2"])


def partial_on_workers(out: Path, settings: list[str]) -> None:
    """Train ``settings`` with partial rollouts into ``out``; check that the workers took
    the offered weights between turns (timing decides where: mid-batch or at its start)."""
    from test_async import turn_versions_move_forward

    train(load_config(None, [*settings, "algorithm.partial_rollouts=true"]), out=out,
          progress=False)  # fmt: skip
    got = rows(out)
    assert all(r["perf/rollout_offer_s"] > 0 for r in got[1:-1])  # after every update
    for r in got[2:]:
        assert r["rollout/policy_lag_tokens_mean"] < 0.95  # tokens sampled by the offers
        assert "rollout/mid_batch_syncs" not in r  # the driver's count: its own engine's
    assert any(r["rollout/episodes_across_versions"] > 0 for r in got[2:])
    for r in got[2:-1]:  # the last step's is the evaluation's, after the final update
        assert "perf/rollout_sync_s" not in r  # the workers took the offers: nothing to sync
    turn_versions_move_forward(out)


def test_an_environment_that_cannot_be_sent_is_refused(tmp_path: Path, local_ray: None) -> None:
    family = Tripwire(tmp_path)
    family.lock = threading.Lock()  # type: ignore[attr-defined]  # no pickle for a lock
    with pytest.raises(ConfigError, match="cannot be sent to the rollout workers"):
        train(config(1), env=family, out=tmp_path / "run", progress=False)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: its workers start"
)
def test_a_worker_that_cannot_start_stops_the_run_with_its_own_error(
    tmp_path: Path, local_ray: None
) -> None:
    """vLLM workers where vLLM is missing, on the cluster at ``cluster.address`` (whose
    nodes the driver cannot check for it beforehand): the run stops with the worker's own
    one-line error, not Ray's page of its remote traceback."""
    settings = ["rollout.backend=vllm", "model.tiny.hidden_size=64", "cluster.address=auto"]
    with pytest.raises(RolloutWorkerError) as caught:
        train(config(1, *settings), out=tmp_path / "run", progress=False)
    message = str(caught.value)
    assert message.startswith(
        "rollout workers: start failed: BackendError: rollout.backend = 'vllm' needs vLLM"
    ), message
    assert "\n" not in message


def test_a_vllm_run_without_vllm_stops_before_building_anything(tmp_path: Path) -> None:
    """In process, or on workers of a local cluster (this Python): checked first."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed")
    settings = ["rollout.backend=vllm", "model.tiny.hidden_size=64"]
    for workers in (0, 2):
        run = tmp_path / f"run{workers}"
        with pytest.raises(BackendError, match=r"rollout\.backend = 'vllm' needs vLLM"):
            train(config(workers, *settings), out=run, progress=False)
        assert not (run / "base_model").exists()


def test_a_worker_asks_ray_for_a_gpu_when_the_policy_is_on_one() -> None:
    """The GPU path's logic on a CPU: with the policy on a GPU every worker asks Ray for
    one GPU (Ray then shows the actor that GPU only: it samples on ``cuda``, device 0),
    and a cluster with fewer GPUs than workers is refused with the counts."""
    assert worker_resources("cpu", 2, 0) == {"num_cpus": 1}
    assert worker_resources("cpu", 2, 4) == {"num_cpus": 1}  # a CPU policy takes no GPU
    assert worker_resources("cuda", 2, 2) == {"num_cpus": 1, "num_gpus": 1}
    with pytest.raises(ConfigError, match="2 rollout workers on GPUs need 2 GPUs, the Ray "
                       "cluster has 1"):  # fmt: skip
        worker_resources("cuda", 2, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_worker_on_the_gpu_samples_there_as_the_policy_does_in_process(
    local_ray: None, model: Any, tokenizer: Any, tiny_model_dir: Path
) -> None:
    """A policy on the GPU: the worker's engine runs on the GPU Ray gave it, and samples
    the same turns as an engine on the GPU in this process, before and after a sync."""
    c = resolved(config(1, "model.device=cuda"))
    family = make_env_family(c.env.name, **c.env.options)
    policy = copy.deepcopy(model).to("cuda")
    sampling, limits = episode_settings(c, tokenizer)
    tasks = [family.task(i) for i in range(4)]
    local = RolloutWorker(c, family, copy.deepcopy(policy), tokenizer, 0, 1, device="cuda")
    workers = RayRolloutWorkers(
        WorkersSpec(c, family, policy, tokenizer, 0, tiny_model_dir), 1, threads=1
    )
    try:
        where = workers.actors[0].__ray_call__.remote(
            lambda w: str(next(w.backend.model.parameters()).device)
        )
        assert ray.get(where, timeout=60) == "cuda:0"
        got = [asyncio.run(workers.collect(tasks, GroupSpec(2, limits, sampling, seed=3)))]
        with torch.no_grad():  # an update
            for p in policy.parameters():
                p.add_(0.01 * torch.randn_like(p))
        workers.sync(policy, 1)
        spec = GroupSpec(2, limits, sampling, seed=3, policy_version=1)
        got.append(asyncio.run(workers.collect(tasks, spec)))
    finally:
        workers.close()
    expected = [local.collect(tasks, GroupSpec(2, limits, sampling, seed=3))]
    local.load_weights({k: v.cpu() for k, v in policy.state_dict().items()}, 1)
    expected.append(local.collect(tasks, GroupSpec(2, limits, sampling, seed=3, policy_version=1)))

    assert [sampled_turns(g) for g in got] == [sampled_turns(g) for g in expected]
    assert {v for *_, v in sampled_turns(got[1])} == {1}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_broadcast_reaches_a_worker_on_another_gpu_over_nccl(
    local_ray: None, model: Any, tokenizer: Any, tiny_model_dir: Path
) -> None:
    """``cluster.weight_sync = "broadcast"`` with the policy on a GPU: NCCL from the
    driver's GPU (the last one) to the worker's (Ray gives the first actor the first);
    the worker then samples as a worker holding the synced weights does. Not yet run: the
    lent machines have one GPU."""
    driver_gpu = torch.cuda.device_count() - 1
    torch.cuda.set_device(driver_gpu)
    c = resolved(config(1, "model.device=cuda", BROADCAST))
    family = make_env_family(c.env.name, **c.env.options)
    policy = copy.deepcopy(model).to("cuda")
    workers = RayRolloutWorkers(
        WorkersSpec(c, family, policy, tokenizer, 0, tiny_model_dir), 1, threads=1,
        weight_sync="broadcast",
    )  # fmt: skip
    try:
        gpus = ray.get(
            workers.actors[0].__ray_call__.remote(lambda w: ray.get_gpu_ids()), timeout=60
        )
        assert [int(g) for g in gpus] != [driver_gpu], "Ray gave the worker the driver's GPU"
        updated(policy)
        workers.sync(policy, 1)
        assert workers._sender is not None
        assert workers._sender.rendezvous.backend == "nccl"
        synced = copy.deepcopy(policy).to("cpu")
        sampled = {}
        sampling, limits = episode_settings(c, tokenizer)
        spec = GroupSpec(2, limits, sampling, seed=3, policy_version=1)
        tasks = [family.task(i) for i in range(4)]
        sampled["worker"] = asyncio.run(workers.collect(tasks, spec))
    finally:
        workers.close()
    local = RolloutWorker(c, family, synced, tokenizer, 1, 1, device="cuda")
    sampled["local"] = local.collect(tasks, spec)

    assert sampled_turns(sampled["worker"]) == sampled_turns(sampled["local"])


LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.lr=0.05"]
ADAPTERS = "adapter_model.safetensors"


def test_a_lora_policy_samples_on_a_worker_as_in_process(tmp_path: Path, local_ray: None) -> None:
    """LoRA adapters reach the worker merged into a plain model (the worker has no peft
    model): the same episodes as the in-process run, whose sampler runs the adapters
    unmerged, and the same metrics up to that float rounding. Each step's samples are the
    synced policy's (the learner's log-probs of them agree), and the adapters moved it."""
    runs = {}
    for name, workers in (("in_process", 0), ("one", 1)):
        runs[name] = tmp_path / name
        train(config(workers, *LORA), out=runs[name], progress=False)
    assert episodes(runs["one"]) == episodes(runs["in_process"])
    expected, got = rows(runs["in_process"]), rows(runs["one"])
    for g, e in zip(got, expected, strict=True):
        for key, value in deterministic(e).items():
            assert g[key] == pytest.approx(value, abs=1e-5), (g["step"], key)
    assert all(r["perf/rollout_sync_s"] > 0 for r in got[1:])
    assert all(r["train/logprob_mismatch_max"] < 1e-4 for r in got[1:])
    adapters = load_file(runs["one"] / "checkpoints" / "step_000003" / "model" / ADAPTERS)
    assert max(float(v.abs().max()) for k, v in adapters.items() if "lora_B" in k) > 1e-3


def test_the_ranks_send_a_lora_policy_s_merged_weights_to_the_workers(
    tmp_path: Path, local_ray: None
) -> None:
    """With LoRA, rank 0 merges the adapters into the gathered weights before it sends
    them (lora.py's ``merge_adapters``, which the driver's ``engine_weights`` uses too):
    the run is the one synced through the driver's model exactly, and the adapters the
    checkpoints hold (the driver's model brought up to date) are the same."""
    out = {}
    for name, sync in (("direct", BROADCAST), ("driver", OBJECT_STORE)):
        out[name] = tmp_path / name
        c = config(2, sync, "cluster.learner_ranks=2", *LORA)
        train(c, out=out[name], progress=False)
    direct, driver = rows(out["direct"]), rows(out["driver"])
    assert [deterministic(r) for r in direct] == [deterministic(r) for r in driver]
    assert episodes(out["direct"]) == episodes(out["driver"])
    assert all("perf/weight_sync_s" not in r and r["perf/rollout_sync_s"] > 0 for r in direct[1:])
    assert all(r["perf/weight_sync_s"] > 0 for r in driver[1:])
    saved = [load_file(out[k] / "checkpoints" / "step_000003" / "model" / ADAPTERS)
             for k in ("direct", "driver")]  # fmt: skip
    assert saved[0].keys() == saved[1].keys()
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    assert max(float(v.abs().max()) for k, v in saved[0].items() if "lora_B" in k) > 1e-3


def test_shards_are_contiguous_and_cover_every_task() -> None:
    assert contiguous_shards(5, 2) == [(0, 3), (3, 5)]
    assert contiguous_shards(1, 3) == [(0, 1), (1, 1), (1, 1)]
    for n in range(12):
        for k in range(1, 5):
            bounds = contiguous_shards(n, k)
            assert [i for lo, hi in bounds for i in range(lo, hi)] == list(range(n))
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    log: Path, process: subprocess.Popen[bytes], pattern: str, timeout_s: float = 120
) -> re.Match[str]:
    """The first match of ``pattern`` in ``process``'s ``log``, once it is there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        if process.poll() is not None:
            raise AssertionError(f"{process.args} exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    raise AssertionError(f"{process.args} printed no {pattern!r} in {timeout_s:.0f} s")


def test_the_command_line_joins_a_cluster_started_with_ray_start(tmp_path: Path) -> None:
    """`ray start --head` without CPUs, a second node joining it with `ray start
    --address` (both on this machine: two raylets, two object stores), then `turnrl train
    --set cluster.rollout_workers=2 --set cluster.address=...` with the learner on two
    ranks placed by Ray: the run completes. The head has no CPU to give, so both workers
    and both ranks run on the second node: the start weights cross from the driver's node
    through Ray's object transfer, and the workers and the learner's rank 0 join the
    broadcast group at the driver's address; rank 0 sends every sync (no gather into the
    driver's model: no ``perf/weight_sync_s``)."""
    log, node_log = tmp_path / "head.log", tmp_path / "node.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_AUTH_MODE", None)  # a ray.init in this process (the fixture) sets it
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # its sockets' paths must be short
    ray_command = str(Path(sys.executable).with_name("ray"))
    node = None
    with log.open("w") as sink:
        head = subprocess.Popen(
            [ray_command, "start", "--head", "--block", f"--port={free_port()}",
             "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={temp}"],
            stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        address = wait_for(log, head, r"ray start --address='([^']+)'")[1]  # for other nodes
        with node_log.open("w") as sink:
            node = subprocess.Popen(
                [ray_command, "start", "--block", f"--address={address}", "--num-cpus=2"],
                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                env={**env, "RAY_AUTH_MODE": "token"},
            )  # fmt: skip
        wait_for(node_log, node, "Ray runtime started")
        command = [
            str(Path(sys.executable).with_name("turnrl")), "train",
            *(f"--set={s}" for s in RUN), "--out", str(tmp_path / "run"), "--no-progress",
            "--set=cluster.rollout_workers=2", f"--set=cluster.address={address}",
            "--set=cluster.learner_ranks=2", "--set=cluster.learner_placement=ray",
        ]  # fmt: skip
        # `ray start` checks a token; the client must be told to send it (Ray 2.60)
        refused = subprocess.run(
            [*command, "--out", str(tmp_path / "refused")], capture_output=True, text=True,
            timeout=600, env=env,
        )  # fmt: skip
        assert refused.returncode != 0
        assert "run with RAY_AUTH_MODE=token" in refused.stderr, refused.stderr[-3000:]
        env["RAY_AUTH_MODE"] = "token"
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"Connecting to existing Ray cluster at address: {address}" in done.stderr
        got = rows(tmp_path / "run")
        assert [r["step"] for r in got] == [0, 1, 2, 3]
        assert all(r["perf/rollout_sync_s"] > 0 for r in got[1:])
        assert not any("perf/weight_sync_s" in r for r in got)
        assert "Started a local Ray instance" not in done.stderr
    finally:
        for process in (node, head):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # SIGTERM drains for 30 s
                process.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
