"""The main job end to end on a very small budget: config errors, the run directory,
reproducibility with the same seed, and resume after a stop."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SMALL_RUN
from turnrl.cli import main
from turnrl.errors import ConfigError
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train

SMALL = SMALL_RUN

DESIGN_METRICS = [
    "rollout/reward_mean",
    "rollout/success_mean",
    "rollout/reward_std_in_group",
    "rollout/zero_variance_groups_frac",
    "rollout/turns_mean",
    "rollout/tool_calls_mean",
    "rollout/tool_errors_frac",
    "rollout/truncated_frac",
    "rollout/template_breaks",
    "loss/policy",
    "loss/entropy",
    "train/grad_norm",
    "train/clip_frac",
    "train/logprob_mismatch",
    "perf/step_s",
    "perf/rollout_s",
    "perf/train_s",
    "perf/tokens_per_s",
]


def rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in row.items() if not k.startswith("perf/") and k != "warmup/s"}


def test_unknown_keys_and_bad_values_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.group_sise'.*group_size"):
        load_config(None, ["rollout.group_sise=4"])
    with pytest.raises(ConfigError, match=r"rollout.group_size must be int"):
        load_config(None, ["rollout.group_size=four"])
    with pytest.raises(ConfigError, match=r"algorithm.control must be one of"):
        load_config(None, ["algorithm.control=maybe"])
    with pytest.raises(ConfigError, match=r"group_size must be >= 2"):
        load_config(None, ["rollout.group_size=1"])
    with pytest.raises(ConfigError, match=r"key=value"):
        load_config(None, ["steps"])
    with pytest.raises(ConfigError, match=r"no recipe 'nope'.*quickstart"):
        load_config("nope")


def test_env_options_are_checked_by_the_env(tmp_path: Path) -> None:
    config = load_config(None, [*SMALL, "env.num_values=3"])
    with pytest.raises(ConfigError, match=r"num_values"):
        train(config, tmp_path / "run", progress=False)


def test_cli_reports_errors_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--set", "nonsense.key=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("turnrl: error: unknown config key 'nonsense'")


def test_run_directory_is_complete_and_reproducible(tmp_path: Path) -> None:
    config = load_config(None, SMALL)
    a, b = tmp_path / "a", tmp_path / "b"
    train(config, a, progress=False)
    train(config, b, progress=False)
    for name in ("config.json", "metrics.jsonl", "trajectories.jsonl", "checkpoints/latest"):
        assert (a / name).is_file(), name
    assert (a / "checkpoints" / "step_000002" / "model" / "config.json").is_file()
    assert json.loads((a / "config.json").read_text())["rollout"]["group_size"] == 2
    metrics = rows(a)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for name in DESIGN_METRICS:
        assert all(name in r for r in metrics[1:]), name
    assert [deterministic(r) for r in metrics] == [deterministic(r) for r in rows(b)]
    trajectories = [
        json.loads(line) for line in (a / "trajectories.jsonl").read_text().splitlines()
    ]
    assert trajectories
    assert all(t["turns"] for t in trajectories)
    with pytest.raises(ConfigError, match=r"already holds a run"):
        train(config, a, progress=False)


def test_resume_continues_the_same_run(tmp_path: Path) -> None:
    four = load_config(None, [*SMALL, "steps=4"])
    straight = tmp_path / "straight"
    train(four, straight, progress=False)
    stopped = tmp_path / "stopped"
    train(load_config(None, SMALL), stopped, progress=False)  # stops after step 2
    train(four, stopped, resume=True, progress=False)
    assert [deterministic(r) for r in rows(stopped)] == [deterministic(r) for r in rows(straight)]
    # The KL reference is the policy RL started from; a resume without it is refused.
    assert four.algorithm.kl.coef > 0
    assert (stopped / "start_model" / "config.json").is_file()
    shutil.rmtree(stopped / "start_model")
    with pytest.raises(ConfigError, match="start_model"):
        train(load_config(None, [*SMALL, "steps=6"]), stopped, resume=True, progress=False)


def test_the_command_line_sums_up_a_resumed_run_from_its_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The closing line's held-out success is the whole run's, from step 0: a resumed run
    evaluated only at its end still reads its start from metrics.jsonl."""
    run = tmp_path / "run"
    flags = [x for s in [*SMALL, "eval.every=10"] for x in ("--set", s)]
    assert main(["train", "--out", str(run), "--no-progress", *flags]) == 0
    capsys.readouterr()
    more = [*flags, "--set", "steps=4"]
    assert main(["train", "--out", str(run), "--no-progress", "--resume", *more]) == 0
    evals = [r for r in rows(run) if "eval/success_mean" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]  # the start, the first end, the end
    first, last = evals[0]["eval/success_mean"], evals[-1]["eval/success_mean"]
    expected = f"turnrl: held-out success {first:.2f} (step 0) -> {last:.2f} (step 4)"
    assert expected in capsys.readouterr().out


def test_a_ppo_run_resumes_with_its_critic(tmp_path: Path) -> None:
    ppo = [*SMALL, "algorithm.advantage=gae", "algorithm.critic.placement=model"]
    straight = tmp_path / "straight"
    train(load_config(None, [*ppo, "steps=3"]), straight, progress=False)
    stopped = tmp_path / "stopped"
    train(load_config(None, [*ppo, "steps=2"]), stopped, progress=False)
    assert (stopped / "checkpoints" / "step_000002" / "extra.pt").is_file()
    train(load_config(None, [*ppo, "steps=3"]), stopped, resume=True, progress=False)
    assert [deterministic(r) for r in rows(stopped)] == [deterministic(r) for r in rows(straight)]


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("grpo", [1.5, -0.5, -0.5, -0.5]),  # (R - mean) / unbiased std (0.5)
        ("dr_grpo", [0.75, -0.25, -0.25, -0.25]),
        ("rloo", [1.0, -1 / 3, -1 / 3, -1 / 3]),
    ],
)
def test_the_configured_group_estimator_is_used(estimator: str, expected: list[float]) -> None:
    from turnrl.trainer.credit import group_advantages
    from turnrl.types import Trajectory

    group = [Trajectory(task_id="t", sample_index=i, reward=float(i == 0)) for i in range(4)]
    (adv,) = group_advantages([group], estimator=estimator)
    assert adv == pytest.approx(expected, abs=1e-5)


def test_an_unknown_estimator_name_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.advantage"):
        load_config("quickstart", ["algorithm.advantage=ppo2"])


@pytest.mark.parametrize(
    "options",
    [
        ["algorithm.advantage=gigpo"],
        ["algorithm.advantage=gae", "algorithm.critic.placement=model"],
        [
            "algorithm.advantage=gae",
            "algorithm.critic.placement=head",
            "algorithm.control=shuffled_rewards",
        ],
        ["algorithm.advantage=reinforce_pp", "algorithm.kl.coef=0.1"],
        ["algorithm.advantage=reinforce_pp_baseline"],
        ["algorithm.policy_loss=gspo", "algorithm.loss_reduction=seq_mean_token_mean"],
        [
            "algorithm.off_policy.correction=token_tis",
            "algorithm.clip.dual=3",
            "algorithm.entropy_coef=0.01",
        ],
    ],
    ids=lambda o: ",".join(x.split(".", 1)[1] for x in o),
)
def test_every_estimator_and_loss_trains_end_to_end(tmp_path: Path, options: list[str]) -> None:
    result = train(load_config(None, [*SMALL, "steps=1", *options]), tmp_path, progress=False)
    (row,) = [r for r in result.rows if "loss/policy" in r]
    for key in ("loss/policy", "train/grad_norm", "train/logprob_mismatch"):
        assert math.isfinite(row[key]), key
    assert row["train/logprob_mismatch"] < 1e-4  # the sampler and the learner agree


def test_dynamic_sampling_trains_only_on_informative_groups(tmp_path: Path) -> None:
    options = ["steps=2", "algorithm.filter.dynamic_sampling=true", "algorithm.filter.max_rounds=3"]
    result = train(load_config(None, [*SMALL, *options]), tmp_path, progress=False)
    rows = [r for r in result.rows if "select/sample_rounds" in r]
    assert len(rows) == 2
    for row in rows:
        assert 1 <= row["select/sample_rounds"] <= 3
        assert row["select/groups_sampled"] == 2 * row["select/sample_rounds"]
        assert row["select/groups_kept"] <= 2
    logged = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    by_group: dict[tuple[int, int], set[float]] = {}
    for t in logged:
        by_group.setdefault((t["step"], t["group"]), set()).add(t["reward"])
    assert all(len(rewards) > 1 for rewards in by_group.values())  # no flat group was kept


def test_variance_filter_and_overlong_shaping_are_applied(tmp_path: Path) -> None:
    options = [
        "steps=1",
        "rollout.prompts_per_step=4",
        "algorithm.filter.variance_keep=0.5",
        "algorithm.overlong.penalty_tokens=40",
        "algorithm.overlong.filter=true",
    ]
    result = train(load_config(None, [*SMALL, *options]), tmp_path, progress=False)
    (row,) = [r for r in result.rows if "select/variance_groups_kept" in r]
    assert row["select/variance_groups_kept"] == 2  # half of 4 groups
    assert row["select/overlong_penalty_mean"] <= 0.0
    assert "select/truncated_excluded" in row
    logged = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert all("overlong_penalty" in t["reward_components"] for t in logged)
    for t in logged:  # the penalty is part of the reward the advantages saw
        base = t["reward"] - t["reward_components"]["overlong_penalty"]
        assert base in (0.0, 1.0)


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp", "gae"])
def test_a_kl_in_the_reward_is_paid_and_recorded(tmp_path: Path, estimator: str) -> None:
    options = [
        "steps=2", "algorithm.kl.placement=reward", "algorithm.kl.coef=0.5",
        "algorithm.kl.estimator=k1", f"algorithm.advantage={estimator}", "algorithm.lr=0.05",
    ]  # fmt: skip
    result = train(load_config(None, [*SMALL, *options]), tmp_path, progress=False)
    trained = [r for r in result.rows if "loss/kl" in r]
    assert all(r["loss/kl"] == 0.0 for r in trained)  # nothing of it in the loss
    logged = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    penalties = [t["reward_components"]["kl_penalty"] for t in logged if t["step"] == 2]
    assert penalties
    assert all(math.isfinite(p) for p in penalties)
    assert any(p != 0.0 for p in penalties)  # step 1's update moved the policy off the reference
    for t in logged:
        base = t["reward"] - (t["reward_components"]["kl_penalty"] if estimator == "grpo" else 0)
        assert base == pytest.approx(float(t["success"]), abs=1e-9)


def test_the_start_up_check_records_the_gap_and_refuses_a_drifting_sampler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from turnrl.backends.engine import DecodeBatch
    from turnrl.errors import BackendError

    train(load_config(None, SMALL_RUN), tmp_path / "same", progress=False)
    first = json.loads((tmp_path / "same" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0.0 <= first["startup/logprob_gap_max"] < 1e-5  # one model samples and learns

    # A sampler whose numbers are not the learner's (here: log-probs reported 0.2 nats off,
    # as an engine in another dtype or with stale weights would) stops the run before step 1.
    completion = DecodeBatch._completion

    def drifting(self: DecodeBatch, row: Any, reason: Any) -> Any:
        out = completion(self, row, reason)
        return dataclasses.replace(out, logprobs=tuple(x - 0.2 for x in out.logprobs))

    monkeypatch.setattr(DecodeBatch, "_completion", drifting)
    with pytest.raises(BackendError, match=r"differ by up to 0\.2"):
        train(load_config(None, SMALL_RUN), tmp_path / "drift", progress=False)
    rows = (tmp_path / "drift" / "metrics.jsonl").read_text()
    assert rows == ""  # nothing was trained or recorded as a step


def test_vllm_on_a_cpu_refuses_heads_its_kernel_cannot_run(tmp_path: Path) -> None:
    from turnrl.backends.vllm_backend import check_cpu_head_size

    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4}')
    with pytest.raises(ConfigError, match=r"has 16 \(64 / 4 heads\).*model.tiny.num_heads = 2"):
        check_cpu_head_size(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 2}')
    check_cpu_head_size(tmp_path)  # 32 wide: runs


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for vLLM's CPU kernel")
def test_a_vllm_run_with_narrow_heads_stops_before_building_the_model(tmp_path: Path) -> None:
    """The tiny model's shape is refused before its pretraining and the warm-up (minutes of
    work on the quick-start), not when the engine starts after them."""
    settings = [
        *SMALL_RUN,
        "rollout.backend=vllm",
        "model.tiny.hidden_size=64",
        "model.tiny.num_heads=4",
    ]
    with pytest.raises(ConfigError, match=r"the tiny model .* has 16 \(64 / 4 heads\)"):
        train(load_config(None, settings), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "base_model").exists()


class CuMemEngine:
    """A test double for a sleep-mode vLLM engine's memory, strict as vLLM 0.26's cumem
    allocator on a GPU: waking a tag that is mapped fails, as does sleeping one that is
    released. It records the calls that reach it."""

    def __init__(self) -> None:
        self.mapped = {"weights", "kv_cache"}
        self.calls: list[tuple[str, Any]] = []

    def sleep(self, level: int) -> None:
        if self.mapped != {"weights", "kv_cache"}:
            raise RuntimeError(f"released twice: {sorted({'weights', 'kv_cache'} - self.mapped)}")
        self.mapped.clear()
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        for tag in tags or ["weights", "kv_cache"]:
            if tag in self.mapped:
                raise RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp:169")
            self.mapped.add(tag)
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: Any) -> None:
        self.calls.append(("reload", sorted(self.mapped)))

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache", None))
        return True


def test_a_sleeping_engine_wakes_each_part_once_across_syncs_and_rollouts() -> None:
    """The colocated GPU cycle, on a CPU: sleep after a rollout, then a sync wakes the
    weights, loads the new ones, then wakes the KV cache alone (on the lent H100 it woke
    everything again, and vLLM's allocator failed mapping the weights twice). Waking an
    awake engine and sleeping a sleeping one reach vLLM not at all."""
    from turnrl.backends.vllm_backend import VLLMBackend

    backend = object.__new__(VLLMBackend)  # the sleep logic alone, without starting vLLM
    backend.llm, backend.sleeps, backend.asleep_tags = CuMemEngine(), True, set()
    backend.sleep_s = backend.wake_s = 0.0
    backend.weights_of = lambda model: model.state_dict()
    backend.policy_version = backend.syncs = 0
    model = torch.nn.Linear(2, 2)
    for _ in range(3):
        backend.sleep()
        backend.sleep()
        assert backend.asleep
        backend.sync(model)
        assert not backend.asleep
        backend.wake_up()  # before a rollout: already awake
    assert backend.llm.calls == 3 * [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("reload", ["weights"]),  # the KV cache stays released while the weights load
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache", None),
    ]
    assert backend.syncs == 3
    assert backend.policy_version == 3
    timings = backend.sleep_metrics()  # the step's row: time spent sleeping and waking
    assert set(timings) == {"perf/engine_sleep_s", "perf/engine_wake_s"}
    assert min(timings.values()) > 0
    assert backend.sleep_metrics() == dict.fromkeys(timings, 0.0)  # since the last call

    backend.sleep()
    backend.wake_up(["weights"])
    backend.sleep()  # half awake: the rest wakes before the whole engine sleeps again
    assert backend.llm.calls[-3:] == [
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
        ("sleep", 1),
    ]
    backend.sleeps = False
    backend.wake_up()
    calls = len(backend.llm.calls)
    backend.sleep()  # an engine without sleep mode never sleeps
    assert len(backend.llm.calls) == calls
    assert not backend.asleep
    assert backend.sleep_metrics() == {}


def test_an_asynchronous_run_s_vllm_engine_never_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Colocated sleep mode frees the GPU for the learner between rollouts; in asynchronous
    training the engine samples while the learner updates, so it is off there (the
    default, sleep on a GPU, stays for synchronous runs)."""
    from turnrl.backends import vllm_backend
    from turnrl.trainer.startup import vllm_sampler

    asked: list[Any] = []
    monkeypatch.setattr(vllm_backend, "VLLMBackend", lambda *a, **k: asked.append(k["sleep"]))
    for k in (0, 1, 2):
        config = load_config(None, ["rollout.backend=vllm", f"algorithm.max_staleness={k}"])
        vllm_sampler(config, None, Path("unused"), dict)
    assert asked == [None, False, False]


def test_the_vllm_engine_runs_in_this_process_on_every_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU too: ``reload_weights`` is handed the learner's tensors, which vLLM's own
    engine process would need serialised (it refuses the function that carries them). Only
    a CPU engine gets the 1 GiB KV cache; a GPU engine without FlashInfer gets vLLM's own
    sampler (on the lent H100, vLLM 0.26's sampler failed importing FlashInfer)."""
    import importlib.util

    from turnrl.backends import vllm_backend

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "flashinfer" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert vllm_backend.engine_environment(on_gpu=True) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    assert vllm_backend.engine_environment(on_gpu=True) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    engine_environment = vllm_backend.engine_environment
    assert engine_environment(on_gpu=False) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
