"""The run's Ray cluster, shared by whatever of it runs on Ray (the rollout workers, the
learner ranks with ``cluster.learner_placement = "ray"``): the first to ``join`` connects
(to ``cluster.address``, or starts a local cluster of this machine), the last to ``leave``
shuts down what this process started. A cluster this process joined but did not start (a
``ray.init`` of the user's own, before the run) is left running.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from turnrl.errors import ConfigError

_lock = threading.Lock()
_members = 0
_owned = False


def join(
    address: str = "",
    min_cpus: int = 0,
    what: str = "cluster.rollout_workers >= 1 runs the rollout workers",
) -> Any:
    """Ray, connected: to the cluster at ``address``, or to a local one of this machine
    with room for ``min_cpus`` one-CPU actors (at least the machine's cores). ``what``
    names who needs Ray in the error when it is not installed."""
    global _members, _owned
    ray = import_ray(what)
    with _lock:
        if not ray.is_initialized():
            options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if not address:
                options["num_cpus"] = max(os.cpu_count() or 1, min_cpus)
                # Ray starts its workers at niceness 15 below the driver: beside a learner
                # update (asynchronous training) or any other work they would get a
                # fraction of a core. The actors are this run's own work: same priority.
                options["_system_config"] = {"worker_niceness": 0}
            try:
                ray.init(address=address or None, **options)
            except ConnectionError as exc:
                raise ConfigError(join_failure(address, exc)) from exc
            _owned = True
        _members += 1
    return ray


def leave() -> None:
    """One member is done; the last one shuts down the cluster if ``join`` started it."""
    global _members, _owned
    with _lock:
        _members = max(0, _members - 1)
        if _members == 0 and _owned:
            import ray

            ray.shutdown()
            _owned = False


def join_failure(address: str, exc: BaseException) -> str:
    """Why the Ray cluster at ``address`` could not be joined, and what to do."""
    message = f"cluster.address = {address!r}: cannot join the Ray cluster: {exc}"
    if "auth" in f"{exc} {exc.__cause__}".lower():  # `ray start` turns token auth on
        message += (
            ". The cluster checks a token (Ray's default for `ray start`): run with "
            "RAY_AUTH_MODE=token, and the head's ~/.ray/auth_token on this machine (or "
            "RAY_AUTH_TOKEN set to it)"
        )
    return message


def import_ray(what: str) -> Any:
    """Ray, or an error saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"{what} as Ray actors: install Ray (pip install 'turnrl[ray]')") from exc
    return ray
