"""The weight sync straight from the learner's ranks to the rollout workers.

With ``cluster.weight_sync = "broadcast"``, learner ranks and rollout workers, a
synchronous run's sync skips the driver: the ranks gather the whole weights from their
shards to rank 0 (``rank.whole_weights``), and rank 0, member 0 of the workers' broadcast
group (weight_broadcast.py), sends them; the driver only coordinates the group
(``Coordinator``: its store, the words "go" and "abort"). Before, the weights went from
rank 0 to the driver through a pipe, into the driver's model, and from there to the
workers: one hop and two copies of the whole model more per sync, and a driver that must
hold the weights, on a GPU where they are sent over NCCL.

A LoRA policy's adapters are merged on rank 0 (lora.py's ``merge_adapters``, the function
the driver's ``engine_weights`` uses): the workers get the same weights either way. Its
frozen base is gathered once, at the first sync, and kept on rank 0 (``_gathered``); each
later sync gathers only the adapters.

The driver's model then lags the learner's weights: it is brought up to date only when
something reads it (``FromRanks.refresh``: a checkpoint, a replacement worker's start
weights). That is safe only while the ranks hold the version the workers sample, as in a
synchronous run. In an asynchronous run the ranks run the next update while the workers
sample, so a worker replaced mid-batch must load a version the ranks no longer hold (and
a read of the ranks would come in the middle of their update): its syncs go through the
driver's model, which keeps a copy of the version synced (driver.py's
``sends_from_ranks`` says which runs use this path).

The rank side is the ``rank_*`` functions (run by ``LearnerGroup.call`` on every rank);
the driver's is ``FromRanks``, which ``RayRolloutWorkers`` drives (rollout_workers.py).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch
import torch.distributed as dist

from turnrl.distributed.rank import ShardedLearner, whole_weights
from turnrl.distributed.weight_broadcast import (
    BroadcastAborted,
    BroadcastError,
    Layout,
    Member,
    Rendezvous,
)
from turnrl.errors import TurnrlError
from turnrl.models.lora import adapter_plan, is_lora, merge_adapters

_MEMBERS: list[Member] = []
"""On rank 0: its membership of the workers' broadcast group (at most one)."""

ABORTED = "aborted"
"""Rank 0's answer when the driver called the group's forming or a sync off."""
ANSWER_MARGIN_S = 60.0
"""How much longer than the group's deadline on a call the driver waits for its answer."""


def rank_join(learner: ShardedLearner, rendezvous: Rendezvous) -> str | None:
    """On every rank; rank 0 joins the workers' group as member 0, leaving any group it was
    in (blocks until every member joins). Rank 0's answer: None when joined, ``ABORTED``
    when the driver called the forming off, else what went wrong (the driver's to handle:
    it forms the group again)."""
    rank_leave(learner)
    if dist.get_rank() != 0:
        return None
    device = "cuda" if rendezvous.backend == "nccl" else "cpu"
    try:
        _MEMBERS.append(Member(rendezvous, 0, device))
    except BroadcastAborted:
        return ABORTED
    except Exception as exc:  # e.g. a member that died while the group was made
        return f"the group did not form: {exc}"
    return None


def rank_send(learner: ShardedLearner, layout: Layout, n: int) -> str | None:
    """On every rank: the whole weights gathered to rank 0 (a collective of the learner's
    ranks; a LoRA policy's adapters merged there, as ``engine_weights`` merges them in the
    driver), which sends them as sync ``n``, in ``layout`` (the workers allocate from it),
    once the driver says "go". Rank 0's answer: None when sent, ``ABORTED`` when called
    off, else what went wrong (a broadcast that failed is the driver's to handle, not an
    error of the rank; weights that do not fit the layout are not sent: rank 0 answers
    before it counts itself ready, and the driver calls the sync off)."""
    lora = is_lora(learner.root)
    whole = _gathered(learner) if lora else whole_weights(learner.root)
    if dist.get_rank() != 0:
        return None
    if lora:  # the workers sample a plain model: the adapters merged
        whole = merge_adapters(whole, adapter_plan(learner.root))
    if not _MEMBERS:
        return "rank 0 is in no weight broadcast group"
    member = _MEMBERS[0]
    weights = {}
    for name, shape, dtype in layout:
        tensor = whole.get(name)
        if tensor is None or tuple(tensor.shape) != tuple(shape):
            got = "nothing" if tensor is None else f"shape {tuple(tensor.shape)}"
            return f"the learner's weights have {got} for {name} (the workers expect {shape})"
        weights[name] = tensor.to(member.device, dtype)
    try:
        return None if member.send(weights, n) else ABORTED
    except BroadcastError as exc:
        return str(exc)


def _gathered(learner: ShardedLearner) -> dict[str, torch.Tensor]:
    """A LoRA policy's whole weights on rank 0 (a collective): the adapters gathered
    anew, the frozen base gathered at the first sync and kept (``frozen_whole``: one whole
    copy of the base in rank 0's CPU memory, which every sync would otherwise gather and
    free again)."""
    if learner.frozen_whole is None:
        whole = whole_weights(learner.root)
        trains = {n for n, p in learner.root.named_parameters() if p.requires_grad}
        learner.frozen_whole = {k: v for k, v in whole.items() if k not in trains}
        return whole
    return {**learner.frozen_whole, **whole_weights(learner.root, trainable=True)}


def rank_leave(learner: ShardedLearner) -> None:
    """On every rank: rank 0 leaves the workers' group, if it is in one."""
    while _MEMBERS:
        _MEMBERS.pop().close()


class FromRanks:
    """The driver's handle on the ranks' side of the sync: it asks the ranks to join and
    to send, each call on a thread of its own (the driver coordinates the group while they
    run), and brings the driver's model up to date when that is read.

    ``learner`` is the run's ``GroupLearner`` (driver.py): its ``group``, its ``model``
    (the driver's copy: the workers' layout, and what a replacement worker starts from once
    ``refresh``ed), and its ``refresh_model``."""

    def __init__(self, learner: Any) -> None:
        self.learner = learner
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="turnrl-ranks")

    @property
    def model(self) -> Any:
        return self.learner.model

    def join(self, rendezvous: Rendezvous) -> concurrent.futures.Future[str | None]:
        """Rank 0 joins the group (``rank_join``): its answer."""
        group = self.learner.group
        return self._pool.submit(lambda: group.call(rank_join, rendezvous)[0])

    def send(self, layout: Layout, n: int) -> concurrent.futures.Future[str | None]:
        """The ranks gather and rank 0 sends sync ``n`` (``rank_send``): its answer."""
        group = self.learner.group
        return self._pool.submit(lambda: group.call(rank_send, layout, n)[0])

    def answer(self, call: concurrent.futures.Future[str | None]) -> str | None:
        """What ``join`` or ``send`` answered. A rank that died, hung or raised raises
        ``LearnerRankError`` here (the group's own deadline on every call bounds the
        wait; this one is a second, in case the call itself never ends)."""
        deadline_s = self.learner.group.timeout_s + ANSWER_MARGIN_S
        try:
            return call.result(timeout=deadline_s)
        except concurrent.futures.TimeoutError:
            raise TurnrlError(
                f"the learner's ranks did not answer a weight sync call within {deadline_s:.0f} s"
            ) from None

    def refresh(self) -> None:
        """The driver's model holds the learner's newest weights."""
        self.learner.refresh_model()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
