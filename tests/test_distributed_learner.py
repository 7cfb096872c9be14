"""The LearnerGroup against the in-process Learner: real rank processes, real
torch.distributed (gloo, CPU), the tiny model. Two ranks give the one-process gradient,
update and metrics; the gathered weights are the model's; the checkpoint state round-trips
(across group sizes too); a rank that dies, hangs or raises is named with the call, within
the deadline, and no rank process outlives the group."""

from __future__ import annotations

import collections
import ctypes
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from test_learner import algo
from turnrl.distributed import LearnerGroup, LearnerRankError, message_pickle
from turnrl.distributed.learner_group import shard_by_tokens, split_batch
from turnrl.distributed.rank import (
    ShardedLearner,
    decoder_layers,
    untied_embeddings,
    whole_weights,
)
from turnrl.errors import TurnrlError
from turnrl.models import load_model
from turnrl.models.tiny import TinyModelConfig, build_tiny_model
from turnrl.rollout.batch import Batch, pack
from turnrl.trainer.learner import Learner
from turnrl.trainer.startup import checkpoint_activations
from turnrl.types import Sample

# A sequence-mean reduction (the global sequence count matters, not only the token
# count), micro-batches of 2 (ranks get different numbers of them), an entropy bonus and a
# KL to the reference in the loss: every place a normaliser enters.
CONFIG = algo(
    lr=1e-4, loss_reduction="seq_mean_token_mean", micro_batch__size=2, entropy_coef=0.01,
    kl__coef=0.05,
)  # fmt: skip
TEMPERATURE = 0.9
VOCAB = 1000


def samples(n: int, seed: int) -> list[Sample]:
    """``n`` samples of 20-40 tokens sharing a 12-token prompt (so the learner runs the
    shared prefix once), the loss on the completion, a few masked tokens in between."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(12)]
    out = []
    for _ in range(n):
        ids = prompt + [rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 28))]
        mask = [0] * 14 + [1] * (len(ids) - 14)
        mask[16:18] = [0, 0]  # a tool's output inside the completion
        logprobs = [-rng.uniform(0.5, 8.0) if m else 0.0 for m in mask]
        out.append(Sample(tuple(ids), tuple(mask), tuple(logprobs)))
    return out


def advantages(n: int) -> list[float]:
    return [(-1.0) ** i * (0.25 + 0.1 * i) for i in range(n)]


def batch(n: int = 5, seed: int = 0) -> Batch:
    return pack(samples(n, seed), advantages(n), pad_id=0)


def full_grads(learner: ShardedLearner) -> dict[str, torch.Tensor]:
    """On every rank: the gradients of the last step, whole (a collective)."""
    out = {}
    for name, p in learner.root.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = grad.clone()
    return out


def raise_value_error(learner: ShardedLearner) -> None:
    raise ValueError("raised on purpose")


def segfault_on_rank_1(learner: ShardedLearner) -> None:
    """Rank 1 reads address 0 (a real segmentation fault); rank 0 returns."""
    if torch.distributed.get_rank() == 1:
        ctypes.string_at(0)


class Uneven(torch.nn.Module):
    """Weights whose first dimension does not split evenly over 2 ranks (3 rows: 2 and 1)
    or leaves rank 1 nothing (1 row), a vector, and an output layer tied to the input."""

    def __init__(self) -> None:
        super().__init__()
        self.odd = torch.nn.Linear(5, 3)
        self.single = torch.nn.Parameter(torch.randn(1, 4))
        self.embed = torch.nn.Embedding(7, 5)
        self.out = torch.nn.Linear(5, 7, bias=False)
        self.out.weight = self.embed.weight


def uneven_whole_weights(learner: ShardedLearner) -> tuple[dict[str, Any], dict[str, Any]]:
    """On every rank: ``Uneven`` built from one seed, then sharded over the ranks; its
    weights before sharding and ``whole_weights``'s (rank 0: whole; rank 1: empty)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    module = Uneven()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    fully_shard(module)
    return before, whole_weights(module)


def in_process(model_dir: Path) -> Learner:
    return Learner(load_model(model_dir), CONFIG, temperature=TEMPERATURE)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def groups(tiny_model_dir: Path) -> Iterator[dict[int, tuple[LearnerGroup, dict[str, Any]]]]:
    """A 1-rank and a 2-rank group, each with its state at the start (tests load it
    first: the groups are shared)."""
    made: dict[int, tuple[LearnerGroup, dict[str, Any]]] = {}
    try:
        for n in (1, 2):
            group = LearnerGroup(
                tiny_model_dir, CONFIG, num_ranks=n, temperature=TEMPERATURE, timeout_s=60
            )
            made[n] = (group, group.state_dict())
        yield made
    finally:
        for group, _ in made.values():
            group.close()


@pytest.fixture(scope="module")
def whole_unit_group(tiny_model_dir: Path) -> Iterator[tuple[LearnerGroup, dict[str, Any]]]:
    """2 ranks sharding the model as one FSDP2 unit (``fsdp_unit="model"``)."""
    with LearnerGroup(
        tiny_model_dir, CONFIG, num_ranks=2, temperature=TEMPERATURE, timeout_s=60,
        fsdp_unit="model",
    ) as group:  # fmt: skip
        yield group, group.state_dict()


def fresh(groups: dict[int, tuple[LearnerGroup, dict[str, Any]]], n: int) -> LearnerGroup:
    group, start = groups[n]
    group.load_state_dict(start)
    return group


def whole_layers_while_computing(learner: ShardedLearner) -> dict[str, int]:
    """On every rank: one update, and the most decoder layers of the policy and of the
    KL reference held whole (not as DTensor shards) when a layer starts its forward."""
    most = {"policy": 0, "reference": 0}
    handles = []
    for name, model in (("policy", learner.root), ("reference", learner.reference_root)):
        layers = decoder_layers(model)

        def count(module: Any, args: Any, name: str = name, layers: Any = layers) -> None:
            whole = sum(not isinstance(layer.mlp.up_proj.weight, DTensor) for layer in layers)
            most[name] = max(most[name], whole)

        handles += [layer.register_forward_pre_hook(count) for layer in layers]
    try:
        learner.step(batch())
    finally:
        for handle in handles:
            handle.remove()
    # after the step nothing is held whole, the frozen reference's root included
    for model in (learner.root, learner.reference_root):
        assert all(isinstance(p, DTensor) for p in model.parameters())
    return most


def test_layer_units_hold_one_decoder_layer_whole_at_a_time(
    groups: Any, whole_unit_group: Any
) -> None:
    """``fsdp_unit="layer"`` (the default): while a layer computes, every other decoder
    layer of the policy and of the reference stays a shard; ``"model"`` gathers them all."""
    assert (
        fresh(groups, 2).call(whole_layers_while_computing) == [{"policy": 1, "reference": 1}] * 2
    )
    group, start = whole_unit_group
    group.load_state_dict(start)
    assert group.call(whole_layers_while_computing) == [{"policy": 2, "reference": 2}] * 2


@pytest.mark.parametrize("unit", ["layer", "model"])
def test_either_unit_gives_the_in_process_update_with_a_shared_prefix(
    groups: Any, whole_unit_group: Any, tiny_model_dir: Path, unit: str
) -> None:
    """The rows share a 12-token prompt, which the in-process learner runs once; layer
    units run every row whole (one call per forward on every rank); either way the update
    is the in-process one."""
    reference = in_process(tiny_model_dir)
    s, adv = samples(7, seed=1), advantages(7)
    expected = reference.step_samples(s, adv, pad_id=0)
    if unit == "layer":
        group = fresh(groups, 2)
    else:
        group, start = whole_unit_group
        group.load_state_dict(start)
    got = group.step_samples(s, adv, pad_id=0)
    assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
    assert got["loss/kl"] == pytest.approx(expected["loss/kl"], rel=1e-5, abs=1e-7)
    assert max_diff(group.full_state_dict(), reference.model.state_dict()) < 1e-5
    after = samples(3, seed=4)
    got_kl, expected_kl = group.reference_kl(after, 0), reference.reference_kl(after, 0)
    assert [len(k) for k in got_kl] == [len(k) for k in expected_kl]
    flat = [x for k in got_kl for x in k]
    assert flat == pytest.approx([x for k in expected_kl for x in k], abs=1e-6)
    assert max(flat) > 0


_PROBES: dict[str, Any] = {}
"""On a rank: what ``watch_embeddings`` saw, and its hooks."""


def watch_embeddings(learner: ShardedLearner) -> None:
    """On every rank: from now on, note whether an embedding of the policy or the KL
    reference is ever held whole (not a DTensor shard) when a decoder layer starts."""
    _PROBES.update(policy=False, reference=False, handles=[], head_calls=[])
    for name, model in (("policy", learner.root), ("reference", learner.reference_root)):
        embeddings = untied_embeddings(model)
        assert len(embeddings) == 2

        def look(module: Any, args: Any, name: str = name, embeddings: Any = embeddings) -> None:
            _PROBES[name] |= any(not isinstance(e.weight, DTensor) for e in embeddings)

        def called(module: Any, args: Any, name: str = name) -> None:
            # the root's own call passes [rows, 1, hidden]; the forward code's, [tokens, hidden]
            _PROBES["head_calls"].append((name, "root" if args[0].dim() == 3 else "trained"))

        _PROBES["handles"] += [
            layer.register_forward_pre_hook(look) for layer in decoder_layers(model)
        ] + [embeddings[1].register_forward_pre_hook(called)]


def watched_embeddings(learner: ShardedLearner) -> dict[str, Any]:
    """On every rank: what ``watch_embeddings`` saw (its hooks removed; the output layers'
    calls by caller, counted), whether every parameter is a shard now, and the policy's
    FSDP2 units by class."""
    for handle in _PROBES.pop("handles"):
        handle.remove()
    models = (learner.root, learner.reference_root)
    return {
        **_PROBES,
        "head_calls": collections.Counter(_PROBES["head_calls"]),
        "sharded": all(isinstance(p, DTensor) for m in models for p in m.parameters()),
        "units": [type(m).__name__ for m in learner.root.modules() if "FSDP" in type(m).__name__],
    }


def test_untied_embeddings_are_units_and_the_update_is_the_in_process_one(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Separate input and output embeddings (as from 7B in Qwen2.5) are layer-mode units
    of their own: while a decoder layer computes, both are shards, and the gradient,
    metrics and no-gradient passes are the in-process learner's. The output layer is
    gathered once in a forward: for the trained positions, not for the root's own call
    (after the root's first, which sets FSDP2 up)."""
    model_dir = build_tiny_model(
        tmp_path / "untied", TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4,
        vocab_size=1024, tie_word_embeddings=False),
    )  # fmt: skip
    reference = in_process(model_dir)
    expected = reference.step(batch())
    expected_grads = {n: p.grad for n, p in reference.model.named_parameters()}
    s = samples(3, seed=4)
    with LearnerGroup(
        model_dir, CONFIG, num_ranks=2, temperature=TEMPERATURE, timeout_s=60
    ) as group:
        group.call(watch_embeddings)
        got = group.step(batch())
        seen = group.call(watched_embeddings)
        grads = group.call(full_grads)
        gap, kl = group.sampler_gap(s, 0), group.reference_kl(s, 0)
        weights = group.full_state_dict()
        group.call(watch_embeddings)
        again = group.step(batch())
        seen_again = group.call(watched_embeddings)
    units = ["FSDPQwen2ForCausalLM", "FSDPEmbedding", "FSDPQwen2DecoderLayer",
             "FSDPQwen2DecoderLayer", "FSDPLinear"]  # fmt: skip
    for rank in seen + seen_again:
        assert {k: rank[k] for k in ("policy", "reference", "sharded", "units")} == {
            "policy": False, "reference": False, "sharded": True, "units": units,
        }  # fmt: skip
    # The first step's first forward of each model runs the head in the root's call (FSDP2
    # sets itself up then); no later one does.
    for rank in seen:
        assert rank["head_calls"][("policy", "root")] == 1, rank["head_calls"]
        assert rank["head_calls"][("reference", "root")] <= 1, rank["head_calls"]
        assert rank["head_calls"][("policy", "trained")] >= 1
    for rank in seen_again:
        assert rank["head_calls"][("policy", "root")] == 0, rank["head_calls"]
        assert rank["head_calls"][("reference", "root")] == 0, rank["head_calls"]
        assert rank["head_calls"][("policy", "trained")] >= 1
    assert again["train/grad_norm"] > 0
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for rank_grads in grads:
        assert max_diff(rank_grads, expected_grads) < 1e-5
    assert max_diff(weights, reference.model.state_dict()) < 1e-5
    assert gap == pytest.approx(reference.sampler_gap(s, 0), rel=1e-5)
    flat = [x for k in kl for x in k]
    assert flat == pytest.approx([x for k in reference.reference_kl(s, 0) for x in k], abs=1e-6)
    assert max(flat) > 0
    # a tied weight (the tiny model's) stays the root's
    assert untied_embeddings(load_model(tiny_model_dir)) == []


def test_a_model_without_decoder_layer_classes_is_refused_for_layer_units() -> None:
    with pytest.raises(ValueError, match=r"cluster\.fsdp_unit = 'model'"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_the_gradient_and_metrics_equal_the_in_process_learners(
    groups: Any, tiny_model_dir: Path, num_ranks: int
) -> None:
    reference = in_process(tiny_model_dir)
    reference.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]  # keep the weights
    b = batch()
    expected = reference.step(b)
    expected_grads = {n: p.grad for n, p in reference.model.named_parameters()}

    group = fresh(groups, num_ranks)
    got = group.step(b)
    grads = group.call(full_grads)

    for rank_grads in grads:  # every rank holds the same whole gradient
        assert max_diff(rank_grads, expected_grads) < 1e-5
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert got["loss/kl"] != 0.0 or expected["loss/kl"] == 0.0


def test_step_samples_equals_the_in_process_update(groups: Any, tiny_model_dir: Path) -> None:
    """Samples shared among ranks by tokens, micro-batched on each (one rank has more
    micro-batches): the weights after the update are the in-process learner's."""
    reference = in_process(tiny_model_dir)
    s, adv = samples(7, seed=1), advantages(7)
    expected = reference.step_samples(s, adv, pad_id=0)
    got = fresh(groups, 2).step_samples(s, adv, pad_id=0)
    assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
    assert got["train/num_tokens"] == expected["train/num_tokens"]
    weights = groups[2][0].full_state_dict()
    assert max_diff(weights, reference.model.state_dict()) < 1e-5


def checkpointing(learner: ShardedLearner) -> bool:
    return bool(learner.root.base_model.gradient_checkpointing)


def test_ranks_that_checkpoint_activations_give_the_in_process_update(
    tiny_model_dir: Path,
) -> None:
    """``checkpoint_activations``: every rank's model recomputes its layers in the
    backward, and the update is the in-process learner's with checkpointing on."""
    model = load_model(tiny_model_dir)
    checkpoint_activations(model)
    reference = Learner(model, CONFIG, temperature=TEMPERATURE)
    s, adv = samples(7, seed=1), advantages(7)
    expected = reference.step_samples(s, adv, pad_id=0)
    with LearnerGroup(
        tiny_model_dir, CONFIG, num_ranks=2, temperature=TEMPERATURE, timeout_s=60,
        checkpoint_activations=True,
    ) as group:  # fmt: skip
        assert group.call(checkpointing) == [True, True]
        got = group.step_samples(s, adv, pad_id=0)
        weights = group.full_state_dict()
    assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
    assert max_diff(weights, reference.model.state_dict()) < 1e-5


def test_a_rank_without_data_steps_in_time(groups: Any, tiny_model_dir: Path) -> None:
    """One sequence, two ranks: rank 1 runs empty micro-batches (zero gradient) and the
    update is the one-process update."""
    reference = in_process(tiny_model_dir)
    b = batch(1, seed=2)
    expected = reference.step(b)
    got = fresh(groups, 2).step(b)
    assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
    assert got["train/num_sequences"] == 1.0
    assert max_diff(groups[2][0].full_state_dict(), reference.model.state_dict()) < 1e-5


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_gathered_weights_equal_the_in_process_model_after_a_step(
    groups: Any, tiny_model_dir: Path, num_ranks: int
) -> None:
    reference = in_process(tiny_model_dir)
    group = fresh(groups, num_ranks)
    before = group.full_state_dict()
    assert max_diff(before, reference.model.state_dict()) == 0.0
    reference.step(batch())
    group.step(batch())
    after = group.full_state_dict()
    assert max_diff(after, reference.model.state_dict()) < 1e-5
    assert max_diff(after, before) > 1e-5  # the step did change the weights
    # A snapshot: the next step does not change what the driver was given.
    kept = {k: v.clone() for k, v in after.items()}
    group.step(batch(seed=3))
    assert max_diff(after, kept) == 0.0


LORA = {"rank": 4, "alpha": 8.0, "target_modules": ("all-linear",)}


def lora_driver(model_dir: Path, seed: int) -> Any:
    """The driver's LoRA policy, its adapters moved off their zero start."""
    from test_lora import moved_off_zero
    from turnrl.models.lora import add_lora

    return moved_off_zero(add_lora(load_model(model_dir), **LORA), seed)


@pytest.fixture(scope="module")
def lora_group(tiny_model_dir: Path) -> Iterator[LearnerGroup]:
    """2 ranks training a LoRA policy (the start model with adapters)."""
    import functools

    from turnrl.distributed import with_adapters

    source = functools.partial(with_adapters, functools.partial(load_model, tiny_model_dir), **LORA)
    with LearnerGroup(source, CONFIG, num_ranks=2, temperature=TEMPERATURE, timeout_s=60) as group:
        yield group


def test_a_lora_group_gives_its_adapters_alone_when_asked_for_what_trains(
    lora_group: LearnerGroup, tiny_model_dir: Path
) -> None:
    """``full_state_dict(trainable=True)`` on a LoRA policy's ranks: the adapters whole,
    the frozen base left out (what the driver's model takes after each update); the
    values those of the whole gather, which are the driver's adapters after a load."""
    driver = lora_driver(tiny_model_dir, seed=0)
    trains = {n for n, p in driver.named_parameters() if p.requires_grad}
    lora_group.load_weights(driver.state_dict())
    adapters, whole = lora_group.full_state_dict(trainable=True), lora_group.full_state_dict()
    assert adapters.keys() == trains
    assert all(".lora_" in k for k in adapters)
    assert len(whole) > len(adapters)
    assert all(torch.equal(adapters[k], whole[k]) for k in adapters)
    assert all(torch.equal(adapters[k], driver.state_dict()[k]) for k in adapters)


def gathered_for_a_sync(learner: ShardedLearner) -> dict[str, torch.Tensor]:
    from turnrl.distributed.ranks_to_workers import _gathered

    return _gathered(learner)


def test_a_lora_sync_from_the_ranks_keeps_the_base_until_weights_are_loaded(
    lora_group: LearnerGroup, tiny_model_dir: Path
) -> None:
    """What a sync from the ranks merges (ranks_to_workers.py): the whole weights, the
    frozen base gathered at the first sync and kept, the adapters gathered every time.
    Loading weights (a resume) drops the kept base: the next sync gathers it again."""
    driver = lora_driver(tiny_model_dir, seed=1)
    lora_group.load_weights(driver.state_dict())
    first = lora_group.call(gathered_for_a_sync)[0]
    assert max_diff(first, dict(driver.state_dict())) == 0.0
    lora_group.step(batch())  # the adapters move, the base does not
    after = lora_group.call(gathered_for_a_sync)[0]
    assert max_diff(after, lora_group.full_state_dict()) == 0.0
    assert max_diff(after, first) > 1e-5
    with torch.no_grad():  # another base: loaded, and so gathered again
        for name, p in driver.named_parameters():
            if "base_layer" in name:
                p.add_(0.01)
    lora_group.load_weights(driver.state_dict())
    assert max_diff(lora_group.call(gathered_for_a_sync)[0], dict(driver.state_dict())) == 0.0


def test_sampler_gap_and_reference_kl_equal_the_in_process_learners(
    groups: Any, tiny_model_dir: Path
) -> None:
    reference = in_process(tiny_model_dir)
    group = fresh(groups, 2)
    reference.step(batch())
    group.step(batch())
    s = samples(3, seed=4)
    assert group.sampler_gap(s, 0) == pytest.approx(reference.sampler_gap(s, 0), rel=1e-5)
    assert group.sampler_gap(s[:1], 0) == pytest.approx(reference.sampler_gap(s[:1], 0), rel=1e-5)
    got, expected = group.reference_kl(s, 0), reference.reference_kl(s, 0)
    assert [len(k) for k in got] == [len(k) for k in expected]
    flat = [x for k in got for x in k]
    assert flat == pytest.approx([x for k in expected for x in k], abs=1e-6)
    assert max(flat) > 0  # the policy moved away from the reference


def test_checkpoint_state_round_trips_across_group_sizes(groups: Any) -> None:
    two = fresh(groups, 2)
    two.step(batch())
    state = two.state_dict()
    assert set(state) == {"model", "optimizer"}
    assert max_diff(state["model"], two.full_state_dict()) == 0.0
    # gathered whole, on the CPU, keyed by parameter name, as set_state_dict loads it
    moments = state["optimizer"]["state"]
    assert moments
    assert set(moments) <= set(state["model"])
    for name, moment in moments.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert moment[key].shape == state["model"][name].shape, (name, key)
            assert moment[key].device.type == "cpu"
    assert all(isinstance(p, str) for g in state["optimizer"]["param_groups"] for p in g["params"])
    two.step(batch(seed=5))
    expected = two.full_state_dict()

    two.load_state_dict(state)
    two.step(batch(seed=5))
    assert max_diff(two.full_state_dict(), expected) == 0.0

    one = groups[1][0]
    one.load_state_dict(state)
    one.step(batch(seed=5))
    assert max_diff(one.full_state_dict(), expected) < 1e-5


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_closed_ranks_leave_the_group_cleanly(tiny_model_dir: Path) -> None:
    """``close`` asks each rank to leave: every rank process exits with status 0 (not
    killed, not failed), well before the close deadline."""
    group = LearnerGroup(tiny_model_dir, CONFIG, num_ranks=2, temperature=TEMPERATURE)
    processes = list(group._ranks._processes)  # type: ignore[attr-defined]
    started = time.monotonic()
    group.close()
    assert time.monotonic() - started < 5.0
    assert [p.exitcode for p in processes] == [0, 0]


def test_a_killed_rank_is_named_within_the_deadline(tiny_model_dir: Path) -> None:
    group = LearnerGroup(tiny_model_dir, CONFIG, num_ranks=2, temperature=1.0, timeout_s=30)
    pids = group.pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(LearnerRankError, match=r"rank 1 died \(exit code -9\) during step 1") as e:
        group.step(batch())
    assert time.monotonic() - t0 < 30
    assert e.value.ranks == (1,)
    assert e.value.call == "step 1"
    assert_gone(pids)
    # any later call (another thread's, in an asynchronous run) names the same cause
    with pytest.raises(LearnerRankError, match=r"rank 1 died \(exit code -9\) during step 1"):
        group.full_state_dict()
    group.close()
    with pytest.raises(TurnrlError, match="closed"):
        group.step(batch())


def test_whole_weights_are_gathered_from_uneven_and_empty_shards(
    groups: dict[int, tuple[LearnerGroup, dict[str, Any]]],
) -> None:
    """The weight sync's gather: shards of 2 and 1 rows, of 1 row and none, a vector; the
    tied output layer is the embedding's tensor under both names; rank 1 gets nothing."""
    (before, whole), (_, on_rank_1) = fresh(groups, 2).call(uneven_whole_weights)
    assert sorted(whole) == sorted(before)
    for name, tensor in before.items():
        assert torch.equal(whole[name], tensor), name
        assert whole[name].device.type == "cpu"
    assert whole["out.weight"] is whole["embed.weight"]
    assert on_rank_1 == {}


def test_a_rank_that_segfaults_is_named_with_its_python_stack(tiny_model_dir: Path) -> None:
    """A rank killed by a fatal signal in native code leaves no traceback of its own: the
    error quotes the Python stack faulthandler wrote as it died, down to the function."""
    group = LearnerGroup(tiny_model_dir, CONFIG, num_ranks=2, temperature=1.0, timeout_s=30)
    pids = group.pids
    crash_dir = Path(group._ranks._crash_dir)  # type: ignore[attr-defined]
    with pytest.raises(LearnerRankError) as e:
        group.call(segfault_on_rank_1)
    message = str(e.value)
    assert message.startswith("rank 1 died (exit code -11) during call segfault_on_rank_1")
    assert "rank 1's stack as it died:" in message
    assert "Fatal Python error: Segmentation fault" in message
    assert "in segfault_on_rank_1" in message
    assert e.value.ranks == (1,)
    assert_gone(pids)
    assert not crash_dir.exists()


def test_a_hung_rank_misses_the_deadline_and_the_group_stops(tiny_model_dir: Path) -> None:
    group = LearnerGroup(tiny_model_dir, CONFIG, num_ranks=2, temperature=1.0, timeout_s=30)
    pids = group.pids
    group.step(batch())
    group.timeout_s = 2.0
    os.kill(pids[1], signal.SIGSTOP)  # frozen: alive, silent; rank 0 waits for it
    t0 = time.monotonic()
    with pytest.raises(LearnerRankError, match=r"did not answer step 2 within 2 s") as e:
        group.step(batch())
    assert 2.0 <= time.monotonic() - t0 < 10.0
    assert 1 in e.value.ranks
    assert_gone(pids)


def test_an_error_on_a_rank_is_named_with_its_cause(tiny_model_dir: Path) -> None:
    group = LearnerGroup(tiny_model_dir, CONFIG, num_ranks=1, temperature=1.0, timeout_s=30)
    pids = group.pids
    with pytest.raises(LearnerRankError, match="rank 0 failed in call raise_value_error") as e:
        group.call(raise_value_error)
    assert "ValueError: raised on purpose" in str(e.value)
    assert_gone(pids)


def answer_after(learner: ShardedLearner, value: str, seconds: float) -> tuple[str, int]:
    """On every rank: ``value`` and the rank, after ``seconds``."""
    import torch.distributed as dist

    time.sleep(seconds)
    return value, dist.get_rank()


def test_calls_from_two_threads_take_turns(
    groups: dict[int, tuple[LearnerGroup, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call made while another thread's runs (an asynchronous run's rollout thread asking
    for a replacement worker's weights during the update) waits for it, and each gets its
    own answers. A wait past the running call's deadline (and a margin) is an error naming
    that call."""
    import concurrent.futures

    from turnrl.distributed import learner_group

    group, _ = groups[2]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(group.call, answer_after, "first", 1.0)
        time.sleep(0.2)
        t0 = time.monotonic()
        second = pool.submit(group.call, answer_after, "second", 0.0)
        assert second.result(timeout=60) == [("second", 0), ("second", 1)]
        assert time.monotonic() - t0 > 0.5  # it waited for the first
        assert first.result(timeout=60) == [("first", 0), ("first", 1)]

    monkeypatch.setattr(learner_group, "BUSY_MARGIN_S", -59.0)  # waits 1 s past the deadline
    monkeypatch.setattr(group, "timeout_s", 60.0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(group.call, answer_after, "first", 3.0)
        time.sleep(0.2)
        with pytest.raises(TurnrlError, match=r"busy with call answer_after for more than 1 s"):
            group.call(answer_after, "second", 0.0)
        assert first.result(timeout=60) == [("first", 0), ("first", 1)]
    assert group.call(answer_after, "after", 0.0) == [("after", 0), ("after", 1)]


def test_shards_balance_tokens_and_cover_every_item() -> None:
    lengths = [50, 10, 40, 30, 20, 5]
    shards = shard_by_tokens(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 5
    assert shard_by_tokens([7], 3) == [[0], [], []]

    b = batch(5)
    halves = split_batch(b, 2)
    assert [h.num_sequences for h in halves if isinstance(h, Batch)] == [2, 3]
    micro = split_batch([b.select(slice(0, 1)), b.select(slice(1, 5))], 2)
    assert [[m.num_sequences for m in part] for part in micro if isinstance(part, list)] == [
        [2],
        [1, 2],
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_group_on_the_gpu_over_nccl_equals_the_in_process_learner(tiny_model_dir: Path) -> None:
    """NCCL on as many ranks as there are GPUs (one rank a GPU): the gradient, metrics
    and gathered weights are the CUDA in-process learner's."""
    ranks = torch.cuda.device_count()
    reference = Learner(load_model(tiny_model_dir).cuda(), CONFIG, temperature=TEMPERATURE)
    b = batch()
    expected = reference.step(b)
    with LearnerGroup(
        tiny_model_dir, CONFIG, num_ranks=ranks, temperature=TEMPERATURE, device="cuda",
        timeout_s=120,
    ) as group:  # fmt: skip
        assert group.device == "cuda"
        got = group.step(b)
        weights = group.full_state_dict()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    ours = {k: v.cpu() for k, v in reference.model.state_dict().items()}
    assert max_diff({k: v.cpu() for k, v in weights.items()}, ours) < 1e-5


def test_a_message_to_or_from_a_rank_is_a_snapshot_shared_with_no_process() -> None:
    weights = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(3)}
    data = message_pickle.encode(("ok", weights))
    weights["w"].add_(100.0)  # the sender goes on changing its live tensors
    status, got = message_pickle.decode(data)
    assert status == "ok"
    assert torch.equal(got["w"], torch.arange(6.0).reshape(2, 3))
    assert int(got["step"]) == 3
    assert not got["w"].is_shared()  # its own memory, not a shared-memory segment
    got["w"].add_(1.0)  # writable


WIRE_TENSORS = {
    "float32": torch.arange(6.0).reshape(2, 3),
    "transposed": torch.arange(6.0).reshape(2, 3).t(),
    "scalar": torch.tensor(3),
    "bf16": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
    "empty": torch.empty(0, 4),
    "bool": torch.tensor([True, False, True]),
    "conjugated": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),
    "trainable": torch.tensor([0.5, 1.5], requires_grad=True),
    "parameter": torch.nn.Parameter(torch.ones(2)),  # torch's own pickling
}


@pytest.mark.parametrize("name", sorted(WIRE_TENSORS))
def test_a_tensor_crosses_the_wire_exactly(name: str) -> None:
    sent = WIRE_TENSORS[name]
    got = message_pickle.decode(message_pickle.encode({"t": sent}))["t"]
    assert type(got) is type(sent)
    assert (got.dtype, got.shape, got.requires_grad) == (sent.dtype, sent.shape, sent.requires_grad)
    assert torch.equal(got.detach().resolve_conj(), sent.detach().resolve_conj())


def test_a_message_holds_a_tensors_bytes_and_little_else_and_a_tied_one_stays_one() -> None:
    """A tensor under two names (tied embeddings) is sent once and arrives as one
    tensor."""
    w = torch.randn(256, 256)
    data = message_pickle.encode({"embed": w, "head": w})
    assert w.nbytes < len(data) < w.nbytes + 1024
    got = message_pickle.decode(data)
    assert got["embed"] is got["head"]
    assert torch.equal(got["embed"], w)
