"""The weight sync as a collective broadcast to the rollout workers
(``cluster.weight_sync = "broadcast"``), from the driver or from the learner's rank 0.

The sender (rank 0: the driver, ``Sender``, or the learner's rank 0, a ``Member`` while the
driver only coordinates, ``Coordinator``) and the N workers (ranks 1..N) form a
torch.distributed group of their own, outside any default group a process may have:
gloo for weights in CPU memory, NCCL for weights on GPUs (every member then on a GPU of
its own: NCCL refuses two members on one device). Its rendezvous is a ``TCPStore`` the
driver holds. A sync sends each tensor once, into buffers the workers allocate from the
layout (names, shapes, dtypes) the driver gives them: one broadcast per run of small
tensors of one dtype, flattened into one buffer (``buckets``), and one per larger tensor;
on GPUs the weights go from the driver's GPU to the engines' GPUs without passing through
CPU memory (from the learner's rank 0 they do: it gathers them into CPU memory first).

A collective whose member has died blocks the others until the group's timeout, and an
abort by the sender does not free them (checked with gloo: a receiver waited out its whole
timeout after the sender shut its group down); so does forming a group with a member that
never joins. So forming a group and every sync run in two phases, every wait under a
deadline:

1. Each worker, asked to join (or to receive), adds itself to a counter in the store
   (``joining``, or the sync's ``ready/<n>``) and waits for the driver's word.
2. The driver waits until every worker has come, or until ``failed()`` names one that is
   not coming (it died, or its call raised). The word is then "go" or "abort": on "abort"
   every live worker returns at once, with nothing joined or received
   (``BroadcastAborted``: the caller replaces the dead and forms a new group).
3. On "go", the group's construction (under ``FORM_TIMEOUT_S``) or the broadcasts. A member
   that dies in this phase leaves the others blocked in the collective until its timeout:
   the sender's error says so, and the caller replaces every worker that did not finish.

The pure part, a group's construction and one sync's messages, is here; which workers to
replace, and when, is the rollout workers' (rollout_workers.py).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from turnrl.errors import TurnrlError

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]
"""What a receiver allocates: each tensor's name, shape and dtype, in the order sent."""

POLL_S = 0.005
"""How often, at most, the driver looks at a counter while it waits for the receivers (at
first more often: they are usually there within a millisecond)."""
BUCKET_BYTES = 32 * 2**20
"""The most bytes of tensors sent as one flat buffer (the sender's copy of a bucket is its
only memory beyond the weights; a tensor larger than this goes alone, uncopied)."""
JOIN_TIMEOUT_S = 60.0
"""How long the receivers may take to reach the driver's store and count themselves in (a
worker node that cannot reach the driver's node fails here, not after a sync's deadline)."""
FORM_TIMEOUT_S = 60.0
"""How long the group's construction may take once every member is known to be there
(the construction blocks until every member has joined)."""


class BroadcastError(TurnrlError):
    """A weight broadcast failed; ``ranks`` are the receivers it names (1..N)."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class BroadcastAborted(BroadcastError):
    """A sync was called off before any weight was sent: every live receiver returned
    with nothing; ``ranks`` did not come (dead, failed, or late)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a receiver joins the group: the driver's store, the group's size (the
    driver included), its backend, the deadline of a sync's waits and of joining, and the
    buckets' size (the sender's, so that both sides cut a layout alike)."""

    host: str
    port: int
    world: int
    backend: str
    timeout_s: float
    join_timeout_s: float = 0.0
    bucket_bytes: int = 0


def backend_for(device: str) -> str:
    """The collective backend for weights on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device == "cuda" else "gloo"


def layout_of(weights: Mapping[str, torch.Tensor]) -> Layout:
    """``weights``' layout, in their order."""
    return [(name, tuple(t.shape), t.dtype) for name, t in weights.items()]


def buckets(layout: Layout, max_bytes: int) -> list[list[int]]:
    """``layout``'s tensors (by index, in order) cut into runs of one dtype of at most
    ``max_bytes`` each, a larger tensor alone: each run is one broadcast."""
    out: list[list[int]] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(layout):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        last = layout[out[-1][-1]][2] if out else None
        if out and last == dtype and size + nbytes <= max_bytes:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out


def _group(store: Any, rank: int, rendezvous: Rendezvous) -> Any:
    """This member's process group (blocks until every member has joined the store). Its
    keys are kept apart from the sync's own under a prefix. NCCL's runs on this process's
    current CUDA device (a Ray worker's only visible one)."""
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    keys = dist.PrefixStore("group", store)  # type: ignore[attr-defined]
    world = rendezvous.world
    if rendezvous.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        return dist.ProcessGroupNCCL(keys, rank, world, options)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(keys, rank, world, timeout)  # type: ignore[attr-defined]


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _store(host: str, port: int, timeout_s: float, master: bool) -> Any:
    return dist.TCPStore(  # type: ignore[attr-defined]
        host, port, world_size=None, is_master=master,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
    )  # fmt: skip


class Coordinator:
    """The driver's part in every group: it holds the store, counts the members in before
    the group forms and before each sync, and gives the word ("go" or "abort"). Here every
    member is another process: the learner's rank 0 sends (``Member.send``), the workers
    receive (``cluster.weight_sync = "broadcast"`` with learner ranks: the weights go from
    the ranks to the workers without passing through the driver). ``Sender`` is the driver
    as member 0 itself.

    Made in two steps, because the group's construction blocks until every member joins:
    ``Coordinator(...)`` opens the store (its ``rendezvous`` is what the members need), the
    caller asks the members to join, then ``connect()``."""

    counted = 0
    """Of the group's members, how many are this process (not counted in by the store)."""

    def __init__(
        self,
        host: str,
        num_receivers: int,
        backend: str,
        timeout_s: float,
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:
        # The store listens on every interface; this process reaches it over loopback, and
        # the members at ``host``, this node's address on their network.
        self._store = _store("127.0.0.1", 0, timeout_s, master=True)
        self.rendezvous = Rendezvous(
            host, self._store.port, num_receivers + 1, backend, timeout_s, join_timeout_s,
            BUCKET_BYTES,
        )  # fmt: skip
        self.syncs = 0
        """Syncs begun on this group; the members are told each one's number
        (``next_sync``), and its keys in the store are its own."""

    @property
    def next_sync(self) -> int:
        """The number of the next sync: what each member's ``receive`` or ``send`` is
        given."""
        return self.syncs + 1

    def connect(self, failed: Callable[[], Sequence[int]]) -> None:
        """Say "go" once every member is joining; ``failed()`` names the members known not
        to be coming (``BroadcastAborted`` then, or after ``join_timeout_s``)."""
        what = "the weight broadcast group's forming"
        self._gather("joining", "word/join", what, failed, self.rendezvous.join_timeout_s)

    def open(self, failed: Callable[[], Sequence[int]]) -> int:
        """Begin the next sync: "go" once every member is ready for it (its number, which
        it returns), "abort" and ``BroadcastAborted`` if ``failed()`` names a member first
        or one is not ready within the group's timeout."""
        self.syncs += 1
        n = self.syncs
        what = f"weight broadcast {n}"
        self._gather(f"ready/{n}", f"word/{n}", what, failed, self.rendezvous.timeout_s)
        return n

    def _gather(
        self,
        counter: str,
        word: str,
        what: str,
        failed: Callable[[], Sequence[int]],
        timeout_s: float,
    ) -> None:
        """Wait until every member but this process has added itself to ``counter``, then
        say "go" under ``word``; say "abort" and raise ``BroadcastAborted`` if ``failed()``
        names any member first, or after ``timeout_s``."""
        expected = self.rendezvous.world - self.counted
        deadline = time.monotonic() + timeout_s
        polls = 0
        while (came := self._store.add(counter, 0)) < expected:
            late = list(failed())
            if late or time.monotonic() > deadline:
                self._store.set(word, "abort")
                who = (
                    f"member(s) {', '.join(map(str, late))} failed"
                    if late
                    else f"{expected - came} member(s) did not come within {timeout_s:.0f} s"
                )
                raise BroadcastAborted(f"{what}: {who}", late)
            polls += 1
            time.sleep(min(POLL_S, 1e-4 * 2**polls))
        self._store.set(word, "go")

    def close(self) -> None:
        """Nothing of the group is this process's (the members close their own halves)."""


class Sender(Coordinator):
    """The driver as rank 0 of a group of ``num_receivers + 1`` members: it coordinates and
    sends (the weights from its own model)."""

    counted = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: Any = None

    def connect(self, failed: Callable[[], Sequence[int]]) -> None:
        """Form the group once every receiver is joining (``Coordinator.connect``). A
        construction that fails raises ``BroadcastError``."""
        super().connect(failed)
        self._store.set_timeout(datetime.timedelta(seconds=FORM_TIMEOUT_S))
        try:
            self._group = _group(self._store, 0, self.rendezvous)
        except Exception as exc:  # a member that died since it came
            raise BroadcastError(f"the weight broadcast group did not form: {exc}") from exc
        finally:
            self._store.set_timeout(datetime.timedelta(seconds=self.rendezvous.timeout_s))

    def send(
        self, weights: Mapping[str, torch.Tensor], failed: Callable[[], Sequence[int]]
    ) -> None:
        """One sync of ``weights`` (in ``layout_of(weights)``'s order, each on the group's
        device), after every receiver is ready. ``failed()`` names the receivers known not
        to be coming; if any, or if one is not ready within ``timeout_s``, the sync is
        called off (``BroadcastAborted``). A broadcast that fails raises ``BroadcastError``."""
        assert self._group is not None, "connect() first"
        n = self.open(failed)
        _send_all(self._group, weights, self.rendezvous, n)

    def close(self) -> None:
        """Leave the group (the receivers' halves are closed by their own processes)."""
        _shut(self._group)
        self._group = None


def _send_all(
    group: Any, weights: Mapping[str, torch.Tensor], rendezvous: Rendezvous, n: int
) -> None:
    """Sync ``n``'s broadcasts of ``weights`` from member 0, bucket by bucket."""
    names, tensors = list(weights), list(weights.values())
    for bucket in buckets(layout_of(weights), rendezvous.bucket_bytes):
        try:
            if len(bucket) == 1:
                _broadcast(group, tensors[bucket[0]].detach().contiguous())
            else:  # one flat buffer: one collective for many small tensors
                _broadcast(group, torch.cat([tensors[i].reshape(-1) for i in bucket]))
        except Exception as exc:
            raise BroadcastError(
                f"weight broadcast {n} failed at {names[bucket[0]]}: {exc} (the "
                "receivers that had not finished wait until their "
                f"{rendezvous.timeout_s:.0f} s timeout)"
            ) from exc


class Member:
    """A member of the driver's group in another process: a worker, rank ``rank`` (1..N),
    receives; the learner's rank 0 sends where the driver only coordinates
    (``Coordinator``). Made when the group forms (``connect``); ``BroadcastAborted`` if the
    driver called that off."""

    def __init__(self, rendezvous: Rendezvous, rank: int, device: str) -> None:
        self.rendezvous = rendezvous
        self.rank = rank
        self.device = device
        self._group: Any = None
        self._store = _store(rendezvous.host, rendezvous.port, rendezvous.join_timeout_s, False)
        if not self._word("joining", "word/join", rendezvous.join_timeout_s):
            raise BroadcastAborted("the driver called off the weight broadcast group's forming")
        self._store.set_timeout(datetime.timedelta(seconds=FORM_TIMEOUT_S))
        self._group = _group(self._store, rank, rendezvous)
        self._store.set_timeout(datetime.timedelta(seconds=rendezvous.timeout_s))

    def _word(self, counter: str, word: str, timeout_s: float) -> bool:
        """Add this member to ``counter``, then the driver's word: True for "go". The
        driver gives it within ``timeout_s`` of asking (it asks, then starts waiting); this
        waits twice that, so that it never gives up before the driver's word."""
        self._store.add(counter, 1)
        self._store.wait([word], datetime.timedelta(seconds=2 * timeout_s))
        return bool(self._store.get(word) == b"go")

    def receive(self, layout: Layout, n: int) -> dict[str, torch.Tensor] | None:
        """Sync ``n``'s tensors (the coordinator's ``next_sync``), or None if the driver
        called it off."""
        if not self._word(f"ready/{n}", f"word/{n}", self.rendezvous.timeout_s):
            return None
        out = {}
        for bucket in buckets(layout, self.rendezvous.bucket_bytes):
            sizes = [math.prod(layout[i][1]) for i in bucket]
            flat = torch.empty(sum(sizes), dtype=layout[bucket[0]][2], device=self.device)
            _broadcast(self._group, flat)
            for i, piece in zip(bucket, torch.split(flat, sizes), strict=True):
                name, shape, _ = layout[i]
                out[name] = piece.view(shape)
        return out

    def send(self, weights: Mapping[str, torch.Tensor], n: int) -> bool:
        """As member 0: sync ``n`` of ``weights`` (in the layout the receivers were given),
        once the driver says "go"; False, nothing sent, if it called the sync off. A
        broadcast that fails raises ``BroadcastError``."""
        assert self.rank == 0, "only member 0 sends"
        if not self._word(f"ready/{n}", f"word/{n}", self.rendezvous.timeout_s):
            return False
        _send_all(self._group, weights, self.rendezvous, n)
        return True

    def close(self) -> None:
        _shut(self._group)
        self._group = None


def _shut(group: Any) -> None:
    """Shut ``group`` down; a group whose other members are gone has nothing to free."""
    if group is not None:
        with contextlib.suppress(Exception):
            group.shutdown()
