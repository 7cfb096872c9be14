"""Ctrl-C during training: the first stops the run after the step under way, with that
step's evaluation and a checkpoint, so ``--resume`` loses nothing; the second stops it at
once, as Python does (``KeyboardInterrupt``).

Without this a Ctrl-C loses every step since the last checkpoint (up to ``save_every``).
The handler is installed only on the main thread, and only over Python's own SIGINT
handler: a notebook's, or a caller's, is left alone. It writes its one line with
``os.write``: a signal handler that prints could land inside a ``print`` of the loop's and
raise there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

FIRST = b"\nturnrl: Ctrl-C: stopping after this step, with its checkpoint (Ctrl-C again: now)\n"


@contextlib.contextmanager
def stop_after_step_on_ctrl_c() -> Iterator[threading.Event]:
    """An event set by the first Ctrl-C while the block runs; the handler before it is put
    back when the block ends."""
    asked = threading.Event()
    own = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if threading.current_thread() is not threading.main_thread() or not own:
        yield asked
        return

    def first(signum: int, frame: FrameType | None) -> None:
        asked.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the next one: at once
        with contextlib.suppress(OSError):
            os.write(2, FIRST)

    signal.signal(signal.SIGINT, first)
    try:
        yield asked
    finally:
        if signal.getsignal(signal.SIGINT) is first:
            signal.signal(signal.SIGINT, signal.default_int_handler)
