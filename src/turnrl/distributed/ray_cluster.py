"""The run's Ray cluster, shared by whatever of it runs on Ray (the rollout workers, the
learner ranks with ``cluster.learner_placement = "ray"``): the first to ``join`` connects
(to ``cluster.address``, or starts a local cluster of this machine), the last to ``leave``
shuts down what this process started. A cluster this process joined but did not start (a
``ray.init`` of the user's own, before the run) is left running.

Joining an address has deadlines of its own. Ray gives a head that does not answer about
40 s a try, 20 tries: a wrong address or a head not started would hang the run for 14
minutes. So the address is knocked on first (a TCP connection within ``PROBE_TIMEOUT_S``:
nothing there is an error at once), and Ray is given ``JOIN_TRIES`` tries (about two
minutes) for what answers but is no head (a dashboard's port, say). Both errors name the
setting.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from turnrl.errors import ConfigError

PROBE_TIMEOUT_S = 10.0
"""How long ``join`` waits for the head at ``cluster.address`` to accept a connection."""
JOIN_TRIES = 3
"""How many times Ray tries to reach the head's GCS at ``cluster.address`` (Ray's
``TRIES_VARIABLE``, left as it is where the environment sets it)."""
TRIES_VARIABLE = "RAY_gcs_server_port_wait_time_s"

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
            set_tries = bool(address) and TRIES_VARIABLE not in os.environ
            if address:
                knock(address)
            if set_tries:
                os.environ[TRIES_VARIABLE] = str(JOIN_TRIES)
            try:
                ray.init(address=address or None, **options)
            except (ConnectionError, RuntimeError) as exc:  # RuntimeError: no GCS answered
                raise ConfigError(join_failure(address, exc)) from exc
            finally:
                if set_tries:
                    os.environ.pop(TRIES_VARIABLE, None)
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


def knock(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """A ``ConfigError`` unless something at ``address`` (``HOST:PORT``) accepts a TCP
    connection within ``timeout_s``. Addresses Ray resolves itself (``auto``, ``local``)
    and those without a port are left to Ray."""
    host, port = host_port(address)
    if port is None:
        return
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:  # refused, unreachable, no such host, or the deadline
        reason = "no answer" if isinstance(exc, TimeoutError) else type(exc).__name__
        raise ConfigError(
            f"cluster.address = {address!r}: nothing accepts a connection at {host}:{port} "
            f"within {timeout_s:g} s ({reason}: {exc}). Start the cluster's head there "
            f"(`ray start --head --port={port}`), or give the address `ray start --head` "
            "printed; an empty address starts a local cluster"
        ) from exc


def host_port(address: str) -> tuple[str, int | None]:
    """``address``'s host and port; the port None where it has none."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address, None
    return host.strip("[]"), int(port)


def join_failure(address: str, exc: BaseException) -> str:
    """Why the Ray cluster at ``address`` could not be joined, and what to do."""
    message = f"cluster.address = {address!r}: cannot join the Ray cluster: {exc}"
    if "auth" in f"{exc} {exc.__cause__}".lower():  # `ray start` turns token auth on
        message += (
            ". The cluster checks a token (Ray's default for `ray start`): run with "
            "RAY_AUTH_MODE=token, and the head's ~/.ray/auth_token on this machine (or "
            "RAY_AUTH_TOKEN set to it)"
        )
    elif "Failed to connect to Ray cluster" in str(exc):  # it answered, but as no head
        message += (
            ". Something accepts connections there but did not answer as a Ray head: give "
            "the port `ray start --head` printed (its GCS, 6379 unless --port said), not the "
            "dashboard's"
        )
    return message


def import_ray(what: str) -> Any:
    """Ray, or an error saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"{what} as Ray actors: install Ray (pip install 'turnrl[ray]')") from exc
    return ray
