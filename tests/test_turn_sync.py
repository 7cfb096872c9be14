"""New weights taken mid-batch, between turns (protocols.TurnSync; the pipeline's use of
it, ``algorithm.partial_rollouts``, is tested in tests/test_async.py): the torch engine lets
the turns it is decoding finish, loads the weights on its own thread, then admits what
waited. No turn mixes versions, episodes in flight go on with the new weights, and every
turn's log-probs are those of the weights its version names. vLLM's: test_vllm_backend.py."""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

import test_engine
from conftest import gap_by_version
from turnrl.backends.torch_backend import TorchBackend
from turnrl.protocols import TurnSync
from turnrl.types import Trajectory


def changed(model: Any, seed: int) -> Any:
    """A copy of ``model`` with every weight moved: another policy version."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return other.eval()


def collect(backend: Any, tokenizer: Any) -> list[Trajectory]:
    """Episodes of the warmed-up model, long enough turns for its tool calls."""
    return test_engine.collect(backend, tokenizer, via_run=True, max_tokens=16, seed=7)


class NewWeightsAfter:
    """A ``TurnSync`` whose weights (``model``, the engine's next version) are wanted once
    ``submissions`` more batches of requests were submitted: the batch is then mid-way,
    its episodes at different turns."""

    def __init__(self, backend: Any, model: Any, submissions: int) -> None:
        self.backend, self.model = backend, model
        self.version = backend.policy_version
        self.submissions = backend.submissions + submissions
        self.applied: list[str] = []
        """The thread of each ``apply``."""

    def wanted(self) -> bool:
        return (
            self.backend.submissions >= self.submissions
            and self.backend.policy_version == self.version
        )

    def apply(self) -> None:
        self.applied.append(threading.current_thread().name)
        self.backend.sync(self.model)

    def hook(self) -> TurnSync:
        return TurnSync(self.wanted, self.apply)


def check_mid_batch(
    trajectories: list[Trajectory],
    old: Any,
    new: Any,
    version: int,
    tolerance: float,
    temperature: float = 1.0,
) -> None:
    """Both versions sampled (``old`` is ``version``, ``new`` the next), some episodes
    across the two, each episode's versions in order, and every turn exactly its
    version's weights, within ``tolerance`` (the two differ by far more)."""
    versions = [[turn.policy_version for turn in t.turns] for t in trajectories]
    assert {v for vs in versions for v in vs} == {version, version + 1}
    assert all(vs == sorted(vs) for vs in versions)  # never back to the old weights
    assert sum(len(set(vs)) == 2 for vs in versions) >= 2  # episodes in flight went on
    worst, count = gap_by_version({version: old, version + 1: new}, trajectories, temperature)
    assert count > 100
    assert worst < tolerance
    swapped, _ = gap_by_version({version: new, version + 1: old}, trajectories, temperature)
    assert swapped > 1e-2  # the check can tell the two versions apart


def test_an_engine_mid_batch_takes_new_weights_between_turns(caller: Any, tokenizer: Any) -> None:
    old, new = caller.eval(), changed(caller, seed=3)
    backend = TorchBackend(copy.deepcopy(old), tokenizer)
    sync = NewWeightsAfter(backend, new, submissions=2)
    backend.turn_sync = sync.hook()
    trajectories = collect(backend, tokenizer)
    assert sync.applied == [threading.current_thread().name]  # once, on the torch thread
    assert backend.policy_version == 1
    check_mid_batch(trajectories, old, new, version=0, tolerance=1e-4)


def test_without_the_hook_the_batch_keeps_its_weights(caller: Any, tokenizer: Any) -> None:
    old = caller.eval()
    backend = TorchBackend(copy.deepcopy(old), tokenizer)
    trajectories = collect(backend, tokenizer)
    assert {turn.policy_version for t in trajectories for turn in t.turns} == {0}
    worst, count = gap_by_version({0: old}, trajectories)
    assert count > 100
    assert worst < 1e-4


def test_a_failed_load_is_recorded_by_the_episodes_that_waited_for_it(
    caller: Any, tokenizer: Any
) -> None:
    """A load that raises ends the episodes that waited for the new weights with its
    error (a bad rollout is data), and the batch finishes: nothing hangs."""
    backend = TorchBackend(copy.deepcopy(caller.eval()), tokenizer)
    backend.turn_sync = failing_load(backend, after=2)
    trajectories = collect(backend, tokenizer)
    failed = [t for t in trajectories if t.error is not None]
    assert failed
    assert all("the weights did not load" in str(t.error) for t in failed)
    assert any(t.turns for t in failed)  # failed at a later turn: the first one kept


def failing_load(backend: Any, after: int) -> TurnSync:
    """New weights, whose load raises, wanted once ``after`` more batches of requests were
    submitted (see ``NewWeightsAfter``)."""
    start = backend.submissions

    def load() -> None:
        raise RuntimeError("the weights did not load")

    return TurnSync(lambda: backend.submissions >= start + after, load)
