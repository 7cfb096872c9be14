"""Shared fixtures and helpers: one tiny model per test session, built locally in seconds;
a small-run configuration; float64 tensor helpers for the algorithm tests."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from torch import Tensor

from turnrl.envs import SecretLookup
from turnrl.models import TinyModelConfig, build_tiny_model, load_model, load_tokenizer
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams
from turnrl.trainer.config import WarmupConfig
from turnrl.trainer.warmup import demonstration_trajectories, supervised_warmup, warmup_samples


class Reached(Exception):
    """The held-out success reached the bar: a learning test's run has shown what it had
    to, and stops."""


class UntilSuccess:
    """A run's ``on_row``: keeps every row and the evaluation curve (step, held-out
    success), and raises ``Reached`` at the first evaluation at or above ``bar``."""

    def __init__(self, bar: float) -> None:
        self.bar = bar
        self.rows: list[dict[str, float]] = []
        self.curve: list[tuple[int, float]] = []

    def __call__(self, row: dict[str, float]) -> None:
        self.rows.append(row)
        if "eval/success_mean" in row:
            self.curve.append((int(row["step"]), row["eval/success_mean"]))
            if row["eval/success_mean"] >= self.bar:
                raise Reached


def swe_tests_can_run() -> bool:
    """The swe environment runs a library's own tests with pytest under
    ``/usr/bin/python3`` (apt's python3-pytest, which `make test` installs); CI has it."""
    from turnrl.envs.swe import runner as swe_runner

    command = f"{swe_runner.TEST_PYTHON} -c 'import pytest' 2>/dev/null"
    return os.system(command) == 0 or bool(os.environ.get("CI"))


def first_to_reach(
    bar: float,
    attempts: Sequence[tuple[int, int]],
    run: Callable[[int, int, UntilSuccess], object],
) -> UntilSuccess:
    """A learning test's seeds: ``run(seed, steps, on_row)`` for each (seed, steps) of
    ``attempts`` in turn until one reaches ``bar`` held-out success; that run's
    ``UntilSuccess``. When none does, the test fails with every curve."""
    curves = {}
    for seed, steps in attempts:
        until = UntilSuccess(bar)
        try:
            run(seed, steps, until)
        except Reached:
            return until
        curves[seed] = until.curve
    pytest.fail(f"no seed reached {bar:g} held-out success; curves (step, success): {curves}")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs a worker per core), each worker's torch gets
    its share of the cores: a worker per core each running torch on every core would
    oversubscribe them. Tests that need a thread count set their own (``threads=``)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    config = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=1024)
    return Path(build_tiny_model(out, config, extra_corpus=SecretLookup().corpus()))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


FAMILY_ARCHS = ("qwen2", "qwen3", "llama3", "mistral")
"""One tiny model per chat-template family (``llama`` shares ``qwen2``'s template)."""


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``arch`` -> the directory of a tiny model of that family, random weights, built on
    first use (under a second each; head size 32, as the vLLM path needs)."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            config = TinyModelConfig(
                arch=arch, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                intermediate_size=128, vocab_size=800,
            )  # fmt: skip
            out = tmp_path_factory.mktemp(arch) / "model"
            built[arch] = Path(build_tiny_model(out, config, extra_corpus=SecretLookup().corpus()))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def family_tokenizer(family_model_dir: Callable[[str], Path]) -> Callable[[str], Any]:
    """``arch`` -> the loaded tokenizer of that family's tiny model (shared: do not modify)."""
    loaded: dict[str, Any] = {}

    def get(arch: str) -> Any:
        if arch not in loaded:
            loaded[arch] = load_tokenizer(family_model_dir(arch))
        return loaded[arch]

    return get


@pytest.fixture
def model(tiny_model_dir: Path) -> Any:
    return load_model(tiny_model_dir)


@pytest.fixture
def caller(model: Any, tokenizer: Any) -> Any:
    """The tiny model after a short syntax warm-up: it calls the tool, so episodes have
    several turns."""
    return warmed_up(copy.deepcopy(model), tokenizer, steps=40)


def warmed_up(warm: Any, tokenizer: Any, steps: int) -> Any:
    """``warm`` after ``steps`` of syntax warm-up on secret-lookup demonstrations."""
    spec = SecretLookup(num_keys=2, key_pool=2)
    demos = demonstration_trajectories(
        spec, tokenizer, ChatRenderer(tokenizer), count=256,
        limits=EpisodeLimits(max_turns=4, max_tokens_per_turn=24),
        sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=0,
    )  # fmt: skip
    supervised_warmup(
        warm, warmup_samples(demos), WarmupConfig(steps=steps, batch_size=16, lr=3e-3),
        pad_id=int(tokenizer.pad_token_id), seed=0,
    )  # fmt: skip
    return warm


def gap_by_version(
    models: dict[int, Any], trajectories: Sequence[Any], temperature: float = 1.0
) -> tuple[float, int]:
    """The largest |sampler log-prob - log-prob under ``models[v]``| over every sampled
    token, ``v`` being the policy version its turn records, and the tokens compared: 0 when
    each turn was sampled by exactly the weights of its version (a turn that switched
    weights midway matches neither)."""
    from turnrl.trainer.forward import token_logprobs

    worst, count = 0.0, 0
    for trajectory in trajectories:
        versions: list[list[int]] = []
        for turn in trajectory.turns:  # one list per sample, as ``Trajectory.samples`` cuts
            if turn.new_sample or not versions:
                versions.append([])
            versions[-1] += [-1] * len(turn.prompt_ids)
            versions[-1] += [turn.policy_version] * len(turn.completion_ids)
        for sample, version in zip(trajectory.samples(), versions, strict=True):
            ids = torch.tensor([sample.input_ids])
            for v in set(version) - {-1}:
                mask = torch.tensor([[x == v for x in version]])
                with torch.no_grad():
                    ours, _ = token_logprobs(
                        models[v], ids, torch.ones_like(ids), mask, temperature
                    )
                gap = (ours - torch.tensor([sample.logprobs]))[mask].abs()
                worst, count = max(worst, float(gap.max())), count + int(mask.sum())
    return worst, count


SMALL_RUN = [  # a run of a few seconds: a tiny model, two steps, two tiny groups
    "steps=2",
    "save_every=1",
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.vocab_size=512",
    "model.tiny.echo_steps=0",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_tokens_per_turn=24",
    "warmup.steps=2",
    "warmup.batch_size=4",
    "eval.every=1",
    "eval.num_tasks=4",
]


# Shared by the tensor tests of turnrl.algorithms: exact float64 inputs, modest hypothesis runs.
PROPERTY = settings(max_examples=50, deadline=None)
F64 = torch.float64
NAN = math.nan


def t(values: object) -> Tensor:
    return torch.tensor(values, dtype=F64)


def bools(values: object) -> Tensor:
    return torch.tensor(values, dtype=torch.bool)
