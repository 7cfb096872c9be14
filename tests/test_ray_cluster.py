"""Joining the Ray cluster at ``cluster.address`` (distributed/ray_cluster.py) has deadlines:
an address where nothing listens is an error naming the setting at once, and one where
something listens that is no Ray head is an error after ``JOIN_TRIES`` of Ray's tries, not
after Ray's own twenty (14 minutes)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from turnrl.distributed import ray_cluster
from turnrl.errors import ConfigError
from turnrl.trainer.config import load_config


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never says a word."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.5:6379", ("10.0.0.5", 6379)),
        ("[::1]:6379", ("::1", 6379)),
        ("auto", ("auto", None)),
        ("head", ("head", None)),
        ("head:port", ("head:port", None)),
    ],
)
def test_an_address_s_host_and_port(address: str, expected: tuple[str, int | None]) -> None:
    assert ray_cluster.host_port(address) == expected


def test_a_ray_client_address_is_refused_saying_what_to_give() -> None:
    """The workers and ranks connect to the driver directly: a driver behind Ray Client
    cannot be reached, so ``ray://`` is refused when the settings are read."""
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["cluster.rollout_workers=2", "cluster.address=ray://head:10001"])
    message = str(caught.value)
    assert message.startswith("cluster.address = 'ray://head:10001': Ray Client addresses")
    assert "HEAD_IP:6379" in message


def test_an_address_where_nothing_listens_is_an_error_naming_the_setting() -> None:
    port = closed_port()
    started = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        ray_cluster.knock(f"127.0.0.1:{port}")
    assert time.perf_counter() - started < 5  # refused: at once
    message = str(caught.value)
    assert message.startswith(f"cluster.address = '127.0.0.1:{port}': nothing accepts")
    assert "ConnectionRefusedError" in message
    assert f"ray start --head --port={port}" in message


def test_an_address_that_does_not_answer_is_an_error_within_the_deadline() -> None:
    """A port whose queue of connections is full (it accepts none): a connection there is
    neither taken nor refused, so the knock gives up at its deadline."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = int(server.getsockname()[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # fills the queue
            started = time.perf_counter()
            with pytest.raises(ConfigError) as caught:
                ray_cluster.knock(f"127.0.0.1:{port}", timeout_s=0.5)
            took = time.perf_counter() - started
    assert 0.4 < took < 5
    assert f"nothing accepts a connection at 127.0.0.1:{port} within 0.5 s (no answer" in str(
        caught.value
    )


def test_a_listening_port_passes_the_knock(silent_port: int) -> None:
    ray_cluster.knock(f"127.0.0.1:{silent_port}")
    ray_cluster.knock("auto")  # left to Ray: no port to knock on


def test_something_that_listens_but_is_no_head_is_an_error_after_the_tries_given(
    silent_port: int,
) -> None:
    """Ray's own connect, bounded by ``JOIN_TRIES`` (1 here: about 40 s), in a process of
    its own (a failed ``ray.init`` is not left behind in this one)."""
    pytest.importorskip("ray", reason="Ray is not installed")
    program = (
        "from turnrl.distributed import ray_cluster\n"
        "ray_cluster.JOIN_TRIES = 1\n"
        f"ray_cluster.join('127.0.0.1:{silent_port}')\n"
    )
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300
    )
    took = time.perf_counter() - started
    assert proc.returncode != 0
    assert "ConfigError: cluster.address = '127.0.0.1" in proc.stderr, proc.stderr[-3000:]
    assert "did not answer as a Ray head" in proc.stderr
    assert took < 150, f"{took:.0f} s: more than one of Ray's tries"


def test_the_command_line_names_a_wrong_address_before_building_anything(
    tmp_path: Path,
) -> None:
    port = closed_port()
    run = tmp_path / "run"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("turnrl")), "train", "--out", str(run),
         "--no-progress", "--set=steps=2", "--set=cluster.rollout_workers=1",
         f"--set=cluster.address=127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"turnrl: error: cluster.address = '127.0.0.1:{port}'"), last
    assert not run.exists()  # no start model built, nothing written
