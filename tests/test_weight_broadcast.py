"""The weight broadcast group on its own (weight_broadcast.py): the driver's ``Sender`` (or
its ``Coordinator``, member 0 sending from a process of its own) and receivers in processes
of their own, over gloo, without Ray. What the rollout workers do
with it (replacing workers, forming the group again) is tested in test_rollout_workers.py."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from turnrl.distributed import weight_broadcast
from turnrl.distributed.message_pickle import decode, encode
from turnrl.distributed.weight_broadcast import (
    BroadcastAborted,
    Member,
    Rendezvous,
    Sender,
    backend_for,
    buckets,
    layout_of,
)

TIMEOUT_S = 30.0


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of the dtypes and shapes a state dict holds, a scalar and an empty one too."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 8, generator=g),
        "layer.bias": torch.randn(8, generator=g).to(torch.bfloat16),
        "layer.scale": torch.randn((), generator=g),
        "empty": torch.zeros(0, 4),
        "buffer.positions": torch.arange(7) * (seed + 1),
    }


def receiver_process(rendezvous: Rendezvous, rank: int, plan: list[str], out: Any) -> None:
    """Join as ``rank``, then for each word of ``plan``: "receive" one sync (reporting what
    came), "die" (exit at once, as a killed worker), "idle" (stay alive, never receive).
    A plan of just "die" dies before joining."""
    out.put(("joining", rank))

    def die() -> None:
        out.close()
        out.join_thread()  # what it put is sent before the process ends
        os._exit(3)

    if plan == ["die"]:  # before it joins
        die()
    try:
        receiver = Member(rendezvous, rank, "cpu")
    except BroadcastAborted:
        out.put(("aborted", rank))
        return
    layout = layout_of(weights(0))
    for n, word in enumerate(plan, start=1):
        if word == "die":
            die()
        if word == "idle":
            time.sleep(TIMEOUT_S)
            return
        got = receiver.receive(layout, n)
        # By value (message_pickle.encode): torch's queue pickler would send a tensor's shared
        # memory through a helper of this process, which may have died before it is read.
        out.put((rank, n, None if got is None else encode(got)))
    receiver.close()


@contextlib.contextmanager
def started(
    plans: list[list[str]], timeout_s: float = TIMEOUT_S, connect: bool = True
) -> Iterator[tuple[Sender, list[Any], Any]]:
    """A sender and a receiver process per plan (``receiver_process``), joined into a
    group unless not ``connect``; the sender closed and the processes killed after."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    sender = Sender("127.0.0.1", len(plans), "gloo", timeout_s)
    procs = [
        ctx.Process(target=receiver_process, args=(sender.rendezvous, r, plan, out), daemon=True)
        for r, plan in enumerate(plans, start=1)
    ]
    for p in procs:
        p.start()
    joining = sorted(out.get(timeout=TIMEOUT_S) for _ in procs)  # their imports done
    assert joining == [("joining", r) for r in range(1, len(plans) + 1)]
    try:
        if connect:
            sender.connect(failed=lambda: dead(procs))
        yield sender, procs, out
    finally:
        sender.close()
        for p in procs:
            p.kill()


def dead(procs: list[Any]) -> list[int]:
    return [r for r, p in enumerate(procs, start=1) if p.exitcode is not None]


@pytest.mark.parametrize("bucket_bytes", [1, weight_broadcast.BUCKET_BYTES])
def test_every_receiver_gets_each_sync_exactly_in_its_dtype(
    bucket_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tensor a collective of its own, or runs of one dtype flattened into one (the
    receivers cut them as the sender did)."""
    monkeypatch.setattr(weight_broadcast, "BUCKET_BYTES", bucket_bytes)
    with started([["receive", "receive"], ["receive", "receive"]]) as (sender, procs, out):
        for n in (1, 2):
            assert sender.next_sync == n
            sent = weights(n)
            sender.send(sent, failed=lambda: dead(procs))
            answers = [out.get(timeout=TIMEOUT_S) for _ in procs]
            got = {(rank, k): decode(w) for rank, k, w in answers}
            assert sorted(got) == [(1, n), (2, n)]
            for w in (got[(1, n)], got[(2, n)]):
                assert list(w) == list(sent)  # the layout's order
                for name, tensor in sent.items():
                    assert w[name].dtype == tensor.dtype
                    assert w[name].shape == tensor.shape
                    assert torch.equal(w[name], tensor), name
        for p in procs:
            p.join(TIMEOUT_S)
        assert [p.exitcode for p in procs] == [0, 0]


def test_a_receiver_dead_before_the_group_forms_calls_it_off_and_frees_the_others() -> None:
    with started([["receive"], ["die"]], connect=False) as (sender, procs, out):
        begun = time.monotonic()
        with pytest.raises(BroadcastAborted, match=r"forming: member\(s\) 2 failed") as caught:
            sender.connect(failed=lambda: dead(procs))
        assert caught.value.ranks == [2]
        assert out.get(timeout=TIMEOUT_S) == ("aborted", 1)
        assert time.monotonic() - begun < TIMEOUT_S / 2  # not the store's timeout


def test_a_receiver_dead_before_the_broadcast_calls_it_off_and_frees_the_others() -> None:
    with started([["receive", "receive"], ["receive", "die"]]) as (sender, procs, out):
        sender.send(weights(1), failed=lambda: dead(procs))  # both take the first
        assert sorted(out.get(timeout=TIMEOUT_S)[:2] for _ in procs) == [(1, 1), (2, 1)]
        begun = time.monotonic()
        with pytest.raises(BroadcastAborted, match=r"broadcast 2: member\(s\) 2 failed") as caught:
            sender.send(weights(2), failed=lambda: dead(procs))
        assert caught.value.ranks == [2]
        assert out.get(timeout=TIMEOUT_S) == (1, 2, None)  # the live one got the word
        assert time.monotonic() - begun < TIMEOUT_S / 2  # not the group's timeout


def test_a_receiver_that_never_comes_is_named_after_the_deadline() -> None:
    with started([["receive"], ["idle"]], timeout_s=3.0) as (sender, procs, out):
        begun = time.monotonic()
        with pytest.raises(BroadcastAborted, match=r"1 member\(s\) did not come within 3 s"):
            sender.send(weights(1), failed=lambda: dead(procs))
        assert 3.0 <= time.monotonic() - begun < 10.0
        assert out.get(timeout=TIMEOUT_S) == (1, 1, None)


def sender_process(rendezvous: Rendezvous, plan: list[str], out: Any) -> None:
    """Member 0 in a process of its own (as the learner's rank 0): join, then for each
    word of ``plan``, "send" sync n of ``weights(n)`` (reporting whether it went), or
    "die"."""
    out.put(("joining", 0))
    member = Member(rendezvous, 0, "cpu")
    for n, word in enumerate(plan, start=1):
        if word == "die":
            os._exit(3)
        out.put((0, n, member.send(weights(n), n)))
    member.close()


def test_member_0_in_another_process_sends_while_the_driver_only_coordinates() -> None:
    """The learner's rank 0 sends to the workers (``Coordinator``): every receiver gets
    each sync exactly; a receiver dead before a sync calls it off for member 0 too (it
    sends nothing)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    coordinator = weight_broadcast.Coordinator("127.0.0.1", 2, "gloo", TIMEOUT_S)
    rv = coordinator.rendezvous
    procs = [ctx.Process(target=sender_process, args=(rv, ["send"] * 3, out), daemon=True)] + [
        ctx.Process(target=receiver_process, args=(rv, r, plan, out), daemon=True)
        for r, plan in ((1, ["receive"] * 3), (2, ["receive", "die"]))
    ]
    for p in procs:
        p.start()

    def failed() -> list[int]:
        return [r for r, p in enumerate(procs) if p.exitcode is not None]

    try:
        assert sorted(out.get(timeout=TIMEOUT_S) for _ in procs) == [
            ("joining", r) for r in range(3)
        ]
        coordinator.connect(failed)
        assert coordinator.open(failed) == 1
        answers = sorted((out.get(timeout=TIMEOUT_S) for _ in procs), key=lambda a: a[0])
        assert answers[0] == (0, 1, True)
        for rank, n, data in answers[1:]:
            assert n == 1
            got = decode(data)
            assert list(got) == list(weights(1))
            assert all(torch.equal(got[k], v) for k, v in weights(1).items()), rank
        with pytest.raises(BroadcastAborted, match=r"broadcast 2: member\(s\) 2 failed"):
            coordinator.open(failed)
        assert sorted(out.get(timeout=TIMEOUT_S)[:3] for _ in range(2)) == [
            (0, 2, False),
            (1, 2, None),
        ]
    finally:
        coordinator.close()
        for p in procs:
            p.kill()


def test_the_backend_follows_the_weights_device() -> None:
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == "nccl"


def test_buckets_are_runs_of_one_dtype_within_the_size() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    layout = [
        ("a", (4,), f32), ("b", (2, 2), f32), ("c", (8,), f32),  # 16 + 16 + 32 bytes
        ("d", (3,), bf16), ("e", (100,), f32), ("f", (), f32), ("g", (0, 4), f32),
    ]  # fmt: skip
    assert buckets(layout, 32) == [[0, 1], [2], [3], [4], [5, 6]]
    assert buckets(layout, 1) == [[i] for i in range(7)]
    assert buckets(layout, 2**20) == [[0, 1, 2], [3], [4, 5, 6]]
