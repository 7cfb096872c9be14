"""The weight sync straight from the learner's ranks to the rollout workers.

With ``cluster.weight_sync = "broadcast"``, learner ranks and rollout workers, the sync of a
synchronous run (or of an asynchronous one a step deep) skips the driver: the ranks gather
the whole weights from their shards to rank 0 (``rank.whole_weights``), and rank 0, member 0
of the workers' broadcast group (weight_broadcast.py), sends them; the driver only
coordinates the group (``Coordinator``: its store, the words "go" and "abort"). Before, the
weights went from rank 0 to the driver through a pipe, into the driver's model, and from
there to the workers: one hop and two copies of the whole model more per sync, and a driver
that must hold the weights, on a GPU where they are sent over NCCL.

A LoRA policy's adapters are merged on rank 0 (lora.py's ``merge_adapters``, the function
the driver's ``engine_weights`` uses): the workers get the same weights either way. Its
frozen base is gathered once, at the first sync, and kept on rank 0 (``_gathered``); each
later sync gathers only the adapters.

The driver's model then lags the learner's weights: it is brought up to date only when
something reads it (``GroupLearner.refresh_model``: a checkpoint). A worker started
mid-batch (a replacement) must load the version the others sample. In a synchronous run
the ranks still hold it: the driver's model, brought up to date, gives it. In an
asynchronous run (``max_staleness = 1``: the sync comes between two updates) the ranks are
running the next update while the workers sample, so rank 0 keeps each sync it sent
(``kept_sync``: one more whole copy of the weights in its CPU memory, or a LoRA policy's
adapters beside the base it keeps) and gives it when asked (``rank_kept``), once the
update in progress returns. Deeper pipelines and partial rollouts read the driver's model
after every update: their syncs go through it (driver.py's ``sends_from_ranks`` says which
runs use this path).

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


def rank_send(learner: ShardedLearner, layout: Layout, n: int, keep: bool = False) -> str | None:
    """On every rank: the whole weights gathered to rank 0 (a collective of the learner's
    ranks; a LoRA policy's adapters merged there, as ``engine_weights`` merges them in the
    driver), which sends them as sync ``n``, in ``layout`` (the workers allocate from it),
    once the driver says "go". Rank 0's answer: None when sent, ``ABORTED`` when called
    off, else what went wrong (a broadcast that failed is the driver's to handle, not an
    error of the rank; weights that do not fit the layout are not sent: rank 0 answers
    before it counts itself ready, and the driver calls the sync off). ``keep``: rank 0
    keeps what it sent (``kept_sync``) for ``rank_kept``."""
    lora = is_lora(learner.root)
    gathered = _gathered(learner) if lora else whole_weights(learner.root)
    if dist.get_rank() != 0:
        return None
    if not _MEMBERS:
        return "rank 0 is in no weight broadcast group"
    member = _MEMBERS[0]
    weights = _in_layout(_engine_form(learner, gathered), layout, member.device)
    if isinstance(weights, str):
        return weights
    try:
        sent = member.send(weights, n)
    except BroadcastError as exc:
        return str(exc)
    if not sent:
        return ABORTED
    if keep:  # a LoRA policy's base is kept already (``frozen_whole``)
        frozen = learner.frozen_whole or {}
        learner.kept_sync = (n, {k: v for k, v in gathered.items() if k not in frozen})
    return None


def rank_kept(learner: ShardedLearner, layout: Layout, n: int) -> dict[str, Any] | str | None:
    """On every rank: rank 0's answer is the weights of sync ``n``, which it sent and kept
    (``rank_send``'s ``keep``), in ``layout`` in CPU memory: what a rollout worker started
    while the ranks run the next update loads. Not a collective (the other ranks answer
    None at once). A string says why rank 0 cannot give them."""
    if dist.get_rank() != 0:
        return None
    kept = learner.kept_sync
    if kept is None or kept[0] != n:
        has = "none" if kept is None else f"sync {kept[0]}'s"
        return f"rank 0 kept {has} weights, not sync {n}'s"
    gathered = {**(learner.frozen_whole or {}), **kept[1]}
    return _in_layout(_engine_form(learner, gathered), layout, "cpu")


def _engine_form(
    learner: ShardedLearner, whole: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rank 0's whole weights as an engine samples them: a LoRA policy's adapters merged
    (the workers sample a plain model)."""
    if not is_lora(learner.root):
        return whole
    return merge_adapters(whole, adapter_plan(learner.root))


def _in_layout(
    whole: dict[str, torch.Tensor], layout: Layout, device: str
) -> dict[str, torch.Tensor] | str:
    """``whole``'s tensors in ``layout``'s order, dtypes and device; what does not fit it
    (a weight missing, or of another shape), said."""
    weights = {}
    for name, shape, dtype in layout:
        tensor = whole.get(name)
        if tensor is None or tuple(tensor.shape) != tuple(shape):
            got = "nothing" if tensor is None else f"shape {tuple(tensor.shape)}"
            return f"the learner's weights have {got} for {name} (the workers expect {shape})"
        weights[name] = tensor.to(device, dtype)
    return weights


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
    run), and gives a replacement worker's start weights.

    ``learner`` is the run's ``GroupLearner`` (driver.py): its ``group``, its ``model``
    (the driver's copy: the workers' layout), and its ``refresh_model``. ``keep``: an
    asynchronous run's, where rank 0 keeps each sync it sends and a replacement worker
    starts from that (``start_weights``)."""

    def __init__(self, learner: Any, keep: bool = False) -> None:
        self.learner = learner
        self.keep = keep
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="turnrl-ranks")
        self._sent: tuple[Layout, int] | None = None
        """The last sync asked for: its layout and number."""

    @property
    def model(self) -> Any:
        return self.learner.model

    def join(self, rendezvous: Rendezvous) -> concurrent.futures.Future[str | None]:
        """Rank 0 joins the group (``rank_join``): its answer."""
        group = self.learner.group
        return self._pool.submit(lambda: group.call(rank_join, rendezvous)[0])

    def send(self, layout: Layout, n: int) -> concurrent.futures.Future[str | None]:
        """The ranks gather and rank 0 sends sync ``n`` (``rank_send``): its answer."""
        group, keep = self.learner.group, self.keep
        self._sent = (layout, n)
        return self._pool.submit(lambda: group.call(rank_send, layout, n, keep)[0])

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

    def start_weights(self) -> Any:
        """What a worker started now loads, the weights the others sample: the last sync
        sent. In a synchronous run the ranks hold them still: the driver's model, brought
        up to date. In an asynchronous one the ranks may be in the next update: rank 0's
        copy of the sync (``rank_kept``), asked for once the group's call running now
        returns (an update's length at most, within the group's deadlines)."""
        if not self.keep:
            self.learner.refresh_model()
            return self.model
        assert self._sent is not None, "start_weights before any sync sent"
        layout, n = self._sent
        weights = self.learner.group.call(rank_kept, layout, n)[0]
        if isinstance(weights, str):
            raise TurnrlError(f"a rollout worker's start weights: {weights}")
        return weights

    def close(self) -> None:
        self._pool.shutdown(wait=False)
