"""A ``LearnerGroup``'s ranks as Ray actors (``cluster.learner_placement = "ray"``):
wherever the Ray cluster places them, several nodes included, instead of processes of the
driver on its own machine.

Each rank is a ``RankActor``: it joins the process group through a store the driver holds
on its node's address (a free port; every node must reach the driver's node, as Ray's own
do) and then answers the driver's calls exactly as a local rank's process does (rank.py:
the same set-up, the same commands, the same answers). On GPUs each actor asks Ray for one
GPU (its only visible device); on CPUs for no CPU (the learner's threads are
``RankSpec.num_threads``), spread over the nodes. Ranks are never restarted: an actor that
dies stops the run as a local rank's death does, named, with a resumable checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from turnrl.distributed import message_pickle, ray_cluster
from turnrl.distributed.rank import RankSpec, ShardedLearner, answer, join_group


class RankActor:
    """One learner rank inside a Ray actor."""

    def __init__(self) -> None:
        self.learner: ShardedLearner | None = None

    def start(self, rank: int, world: int, store_address: tuple[str, int], spec: RankSpec) -> bytes:
        """Join the group and build the learner: ("ok", None), or ("error", traceback)."""
        import traceback

        try:
            # Ray shows an actor only the GPUs it was given: its GPU is device 0.
            self.learner = join_group(rank, world, store_address, spec, device_index=0)
        except BaseException:
            return message_pickle.encode(("error", traceback.format_exc()))
        return message_pickle.encode(("ok", None))

    def run(self, payload: bytes) -> bytes:
        """Answer one call of the driver (rank.py's commands)."""
        name, args = message_pickle.decode(payload)
        assert self.learner is not None, "the rank was not started"
        return answer(self.learner, name, args)

    def leave(self) -> None:
        """Leave the process group (before the actor is stopped)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def pid(self) -> int:
        return os.getpid()


class RayRanks:
    """The driver's side: ``num_ranks`` ``RankActor``s on the Ray cluster at ``address``
    (a local one of this machine when ""), started with ``spec``. ``min_cpus``: the one-CPU
    actors a local cluster must also have room for (the run's rollout workers)."""

    def __init__(self, spec: RankSpec, num_ranks: int, *, address: str, min_cpus: int) -> None:
        self.ray = ray_cluster.join(
            address, min_cpus, what="cluster.learner_placement = 'ray' runs the learner ranks"
        )
        self._actors: list[Any] = []
        # A group dropped without ``close`` still stops its actors and leaves the cluster.
        self._release = weakref.finalize(self, _release, self.ray, self._actors)
        try:
            resources: dict[str, Any]
            if spec.device == "cuda":
                gpus = int(self.ray.cluster_resources().get("GPU", 0))
                if gpus < num_ranks:
                    raise ValueError(
                        f"{num_ranks} ranks need {num_ranks} GPUs, the Ray cluster has {gpus}"
                    )
                resources = {"num_gpus": 1}
            else:
                resources = {"num_cpus": 0, "scheduling_strategy": "SPREAD"}
            host = self.ray.util.get_node_ip_address()
            # The rendezvous: a store on a free port of the driver's node, held here.
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                host, 0, is_master=True, wait_for_workers=False
            )
            address_of_store = (host, int(self._store.port))
            actor = self.ray.remote(max_restarts=0, **resources)(RankActor)
            self._actors.extend(actor.remote() for _ in range(num_ranks))
            self._pending: dict[int, Any] = {
                rank: a.start.remote(rank, num_ranks, address_of_store, spec)
                for rank, a in enumerate(self._actors)
            }
        except BaseException:
            self.kill()
            raise
        self._dead: dict[int, str] = {}
        self._pids: list[int] = []

    def send(self, rank: int, payload: bytes) -> None:
        self._pending[rank] = self._actors[rank].run.remote(payload)

    def answers(self, ranks: Sequence[int], timeout_s: float) -> list[tuple[int, Any]]:
        live = [r for r in ranks if r not in self._dead]
        if not live:
            return []
        refs = [self._pending[r] for r in live]
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=max(timeout_s, 0.0))
        got = []
        for rank in live:
            if self._pending[rank] not in ready:
                continue
            try:
                got.append((rank, message_pickle.decode(self.ray.get(self._pending[rank]))))
            except self.ray.exceptions.RayActorError as exc:
                self._dead[rank] = _why(exc)
            except self.ray.exceptions.RayTaskError as exc:  # e.g. an answer that fails to decode
                got.append((rank, ("error", str(exc))))
        return got

    def dead(self) -> list[int]:
        return sorted(self._dead)

    def death(self, rank: int) -> str:
        return self._dead.get(rank, "alive")

    def last_stack(self, rank: int) -> str:
        """Always empty: an actor's fatal-signal report goes to its Ray worker log, which
        Ray streams to the driver's console."""
        return ""

    def await_deaths(self, ranks: Sequence[int], timeout_s: float) -> None:
        refs = {self._pending[r]: r for r in ranks if r not in self._dead}
        if not refs:
            return
        ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError as exc:
                self._dead[refs[ref]] = _why(exc)
            except Exception:
                pass  # an answer or an error of its own: read again by ``answers``

    def pids(self) -> list[int]:
        if not self._pids:
            self._pids = [int(p) for p in self.ray.get([a.pid.remote() for a in self._actors])]
        return list(self._pids)

    def close(self, timeout_s: float) -> None:
        leaving = [a.leave.remote() for a in self._actors]
        with contextlib.suppress(Exception):  # a rank already gone
            if leaving:
                self.ray.wait(leaving, num_returns=len(leaving), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        self._release()  # once: later calls do nothing


def _release(ray: Any, actors: Sequence[Any]) -> None:
    """Kill ``actors`` and leave the run's Ray cluster (the last to leave shuts down a
    cluster the run started)."""
    for a in actors:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(a)
    ray_cluster.leave()


def _why(exc: BaseException) -> str:
    """A Ray actor's death in a few words: its exit detail where Ray gives one."""
    text = str(exc).strip().splitlines()
    detail = next((line.strip() for line in text if "exit" in line.lower()), "")
    return f"its Ray actor died: {detail}" if detail else "its Ray actor died"
