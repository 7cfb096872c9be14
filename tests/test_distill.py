"""On-policy distillation (``algorithm.teacher``): the per-token advantage against
hand-computed values, its gradient through the policy loss, the trainer's teacher term on
scripted trajectories, the configuration's errors, the vocabulary check, and tiny runs
with a teacher: scored, from a run's directory, resumed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import SMALL_RUN
from turnrl.algorithms import clipped_policy_loss, distillation_advantages, kl_k2
from turnrl.errors import ConfigError
from turnrl.trainer.config import load_config
from turnrl.trainer.config.help import HELP
from turnrl.trainer.loop import train
from turnrl.trainer.step import distill
from turnrl.trainer.teacher import check_vocabularies, teacher_model_path
from turnrl.types import Trajectory, Turn

LOG_HALF, LOG_QUARTER = math.log(0.5), math.log(0.25)


def t(*rows: Any) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# --- the pure function ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("student", "teacher", "rl", "coef", "expected"),
    [
        # k1 = log 0.5 - log 0.25 = 0.693147: the teacher finds the token less likely
        pytest.param(0.5, 0.25, 0.0, 1.0, -0.693147, id="teacher-doubts-it"),
        pytest.param(0.25, 0.5, 0.0, 1.0, 0.693147, id="teacher-prefers-it"),
        pytest.param(0.5, 0.5, 0.0, 1.0, 0.0, id="agree"),
        # added to an RL advantage of 1 with coef 0.5: 1 - 0.5 * 0.693147
        pytest.param(0.5, 0.25, 1.0, 0.5, 0.653426, id="added-to-rl"),
        pytest.param(0.25, 0.5, -1.0, 2.0, 0.386294, id="added-coef-2"),
    ],
)
def test_hand_computed_values(
    student: float, teacher: float, rl: float, coef: float, expected: float
) -> None:
    adv = distillation_advantages(
        t([rl]), t([math.log(student)]), t([math.log(teacher)]), torch.tensor([[True]]), coef=coef
    )
    assert adv.item() == pytest.approx(expected, abs=1e-6)


def test_masked_slots_are_zero_whatever_they_hold_and_sequence_advantages_broadcast() -> None:
    nan, inf = float("nan"), float("inf")
    mask = torch.tensor([[True, False, True], [False, True, False]])
    student = t([LOG_HALF, nan, LOG_QUARTER], [inf, LOG_HALF, -inf])
    teacher = t([LOG_QUARTER, -inf, LOG_HALF], [nan, LOG_HALF, inf])
    per_sequence = t([1.0], [-0.5])  # [B, 1]
    adv = distillation_advantages(per_sequence, student, teacher, mask, coef=1.0)
    expected = t([1 - 0.693147, 0.0, 1 + 0.693147], [0.0, -0.5, 0.0])
    assert torch.allclose(adv, expected, atol=1e-6)
    per_token = t([0.0, nan, 0.0], [inf, 0.0, nan])  # bad values in masked slots only
    adv = distillation_advantages(per_token, student, teacher, mask, coef=1.0)
    assert torch.isfinite(adv).all()
    assert adv[~mask].eq(0).all()


def test_the_result_is_detached_data() -> None:
    student = t([LOG_HALF, LOG_QUARTER]).requires_grad_()
    teacher = t([LOG_QUARTER, LOG_HALF]).requires_grad_()
    adv = distillation_advantages(
        torch.zeros(1, 2), student, teacher, torch.ones(1, 2, dtype=torch.bool), coef=1.0
    )
    assert not adv.requires_grad


def test_through_the_policy_loss_its_gradient_is_the_reverse_kl_gradient() -> None:
    """At the first pass (ratio 1) the policy gradient with the teacher's advantage equals
    coef x the gradient of k2 = (log pi_s - log pi_t)^2 / 2, whose gradient is the reverse
    KL's (docs/algorithms.md): the advantage form trains what a k2 loss term would."""
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(3, 5, generator=gen, dtype=torch.float64) - 2
    teacher = torch.randn(3, 5, generator=gen, dtype=torch.float64) - 2
    mask = torch.rand(3, 5, generator=gen) > 0.3
    coef = 0.7
    adv = distillation_advantages(torch.zeros(3, 1), student, teacher, mask, coef=coef)
    lp = student.clone().requires_grad_()
    clipped_policy_loss(lp, student, adv, mask).per_token_loss.sum().backward()
    k2 = student.clone().requires_grad_()
    (coef * kl_k2(k2, teacher, mask)).sum().backward()
    assert lp.grad is not None
    assert k2.grad is not None
    assert torch.allclose(lp.grad, k2.grad, atol=1e-12)


def test_equals_a_naive_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    rl = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    student = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    teacher = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=gen) > 0.5
    adv = distillation_advantages(rl, student, teacher, mask, coef=0.3)
    for b in range(4):
        for i in range(6):
            want = rl[b, i] - 0.3 * (student[b, i] - teacher[b, i]) if mask[b, i] else 0.0
            assert adv[b, i].item() == pytest.approx(float(want), abs=1e-12)


# --- the trainer's teacher term on scripted trajectories --------------------------------------


def trajectory(logprobs: list[float], reward: float, error: str | None = None) -> Trajectory:
    """One turn: two prompt tokens, then one sampled token per log-prob."""
    turn = Turn((1, 2), tuple(range(3, 3 + len(logprobs))), tuple(logprobs), "stop")
    return Trajectory("task", 0, turns=[turn], reward=reward, error=error)


class ScriptedTeacher:
    """A learner whose teacher gives every sampled token log 0.25."""

    def __init__(self) -> None:
        self.scored = 0

    def teacher_logprobs(self, samples: Any, pad_id: int) -> list[list[float]]:
        self.scored += len(samples)
        return [[LOG_QUARTER if m else 0.0 for m in s.loss_mask] for s in samples]


def parts_with(alone: bool, coef: float = 1.0) -> Any:
    config = load_config(
        None, ["algorithm.teacher.path=somewhere", f"algorithm.teacher.coef={coef}",
               f"algorithm.teacher.alone={str(alone).lower()}"],
    )  # fmt: skip
    return SimpleNamespace(
        config=config, learner=ScriptedTeacher(), backend=SimpleNamespace(pad_id=0)
    )


@pytest.mark.parametrize("alone", [False, True])
def test_the_step_adds_the_teacher_term_to_every_sampled_token(alone: bool) -> None:
    groups = [[trajectory([LOG_HALF, LOG_QUARTER], 1.0), trajectory([LOG_HALF], 0.0, "boom")]]
    values: list[list[Any]] = [[[0.5], [-0.5]]]  # one value per sample (a group estimator)
    parts, row = parts_with(alone), {}
    out = distill(parts, groups, values, row)
    base = 0.0 if alone else 0.5
    # prompt tokens keep the estimator's value (never read); sampled ones gain -k1
    assert out[0][0][0] == pytest.approx([base, base, base - math.log(2), base], abs=1e-9)
    assert out[0][1] == [-0.5]  # not trained on (an error): untouched, not scored
    assert parts.learner.scored == 1
    assert row["distill/reverse_kl_mean"] == pytest.approx(math.log(2) / 2)
    assert row["distill/teacher_logprob_mean"] == pytest.approx(LOG_QUARTER)
    assert row["distill/tokens"] == 2.0
    assert values == [[[0.5], [-0.5]]]  # the estimator's values are not changed in place


def test_per_token_values_and_coef() -> None:
    groups = [[trajectory([LOG_HALF], 1.0)]]
    out = distill(parts_with(False, coef=2.0), groups, [[[[0.1, 0.2, 0.3]]]], {})
    assert out[0][0][0] == pytest.approx([0.1, 0.2, 0.3 - 2 * math.log(2)])


def test_without_a_teacher_the_values_are_the_estimators() -> None:
    values: list[list[Any]] = [[[1.0]]]
    parts = SimpleNamespace(config=load_config(None))
    assert distill(parts, [[trajectory([LOG_HALF], 1.0)]], values, {}) is values


# --- configuration --------------------------------------------------------------------------


def test_every_teacher_key_has_help() -> None:
    assert set(HELP["TeacherConfig"]) == {"path", "coef", "alone"}
    assert all(HELP["TeacherConfig"].values())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.teacher.pth=x", r"unknown config key 'algorithm.teacher.pth'; did you mean "
         r"'algorithm.teacher.path'"),
        ("algorithm.teacher_path=x", r"did you mean 'algorithm.teacher.path'"),
        ("algorithm.techer.coef=1", r"did you mean 'algorithm.teacher"),
        ("algorithm.teacher.path=http://localhost:8000/v1", r"server .*not supported"),
        ("algorithm.teacher.coef=-1", r"algorithm.teacher.coef must be >= 0"),
        ("algorithm.teacher.alone=true", r"alone .*needs a teacher"),
        ("algorithm.teacher.coef=yes", r"algorithm.teacher.coef must be float"),
    ],
)  # fmt: skip
def test_config_errors_are_clear(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_config_errors_that_span_sections() -> None:
    with pytest.raises(ConfigError, match=r"coef must be > 0 with a teacher"):
        load_config(None, ["algorithm.teacher.path=t", "algorithm.teacher.coef=0"])
    with pytest.raises(ConfigError, match=r"a KL in the reward would be dropped"):
        load_config(None, ["algorithm.teacher.path=t", "algorithm.teacher.alone=true",
                           "algorithm.kl.coef=0.1", "algorithm.kl.placement=reward"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"cluster.learner_ranks"):
        load_config(None, ["algorithm.teacher.path=t", "cluster.learner_ranks=2"])
    ok = load_config(None, ["algorithm.teacher.path=t", "algorithm.teacher.alone=true"])
    assert ok.algorithm.teacher.alone


def test_vocabularies_must_be_one() -> None:
    student = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1, "<|im_end|>": 2})
    same = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1, "<|im_end|>": 2})
    other = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 2, "c": 1})
    check_vocabularies(student, same, "student-dir", "teacher-dir")
    with pytest.raises(ConfigError) as err:
        check_vocabularies(student, other, "student-dir", "teacher-dir")
    text = str(err.value)
    assert "teacher-dir" in text
    assert "student-dir" in text
    assert "1 tokens only in the student's (e.g. '<|im_end|>')" in text
    assert "1 only in the teacher's (e.g. 'c')" in text
    assert "1 with another id (e.g. 'b')" in text


# --- tiny runs with a teacher -----------------------------------------------------------------


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("teacher") / "run"
    train(load_config(None, [*SMALL_RUN, "seed=1"]), run, progress=False)
    return run


def test_a_run_directory_names_its_latest_checkpoint(teacher_run: Path, tmp_path: Path) -> None:
    latest = (teacher_run / "checkpoints" / "latest").read_text().strip()
    assert teacher_model_path(str(teacher_run)) == teacher_run / "checkpoints" / latest / "model"
    step1 = teacher_run / "checkpoints" / "step_000001"
    assert teacher_model_path(str(step1)) == step1 / "model"
    model = teacher_run / "start_model"
    assert teacher_model_path(str(model)) == str(model)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="run directory without a checkpoint"):
        teacher_model_path(str(tmp_path))


def test_a_teacher_identical_to_the_student_scores_zero_reverse_kl(
    teacher_run: Path, tmp_path: Path
) -> None:
    """A student of the teacher run's seed starts from its start policy (the same build):
    at step 1 the teacher's log-probs are the sampler's, so the reverse KL is 0 to float
    rounding; a student of another seed (another initialisation, the same tokenizer)
    differs from the teacher (the run directory: its latest checkpoint)."""
    same = [*SMALL_RUN, "steps=1", "seed=1", "algorithm.teacher.alone=true",
            f"algorithm.teacher.path={teacher_run / 'start_model'}"]  # fmt: skip
    first = rows(train(load_config(None, same), tmp_path / "same", progress=False).run_dir)[1]
    assert first["distill/tokens"] > 0
    assert abs(first["distill/reverse_kl_mean"]) < 1e-5
    trained = [*SMALL_RUN, "steps=1", f"algorithm.teacher.path={teacher_run}"]
    row = rows(train(load_config(None, trained), tmp_path / "trained", progress=False).run_dir)[1]
    assert abs(row["distill/reverse_kl_mean"]) > 1e-4
    assert row["distill/teacher_logprob_mean"] < 0
    assert row["perf/teacher_s"] > 0


def test_a_teacher_of_another_vocabulary_is_refused_before_the_warmup(
    teacher_run: Path, tmp_path: Path
) -> None:
    other = [*SMALL_RUN, "model.tiny.vocab_size=600", f"algorithm.teacher.path={teacher_run}"]
    with pytest.raises(ConfigError, match=r"the teacher's tokenizer .*differs from the student's"):
        train(load_config(None, other), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "start_model").exists()  # refused before the warm-up


def test_a_distilling_run_resumes_as_the_same_run(teacher_run: Path, tmp_path: Path) -> None:
    base = [*SMALL_RUN, f"algorithm.teacher.path={teacher_run / 'checkpoints' / 'step_000002'}"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(load_config(None, [*base, "steps=3"]), straight, progress=False)
    train(load_config(None, base), stopped, progress=False)  # stops after step 2
    train(load_config(None, [*base, "steps=3"]), stopped, resume=True, progress=False)

    def same(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if not k.startswith("perf/") and k != "warmup/s"}

    assert [same(r) for r in rows(stopped)] == [same(r) for r in rows(straight)]
    assert "distill/reverse_kl_mean" in rows(stopped)[-1]
