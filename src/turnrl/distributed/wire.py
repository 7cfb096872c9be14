"""What the driver and its learner ranks send each other: plain pickles, tensors by value.

A ``multiprocessing`` queue or pipe pickles with torch's reducers, which move each tensor
through shared memory and pass its file descriptor from a helper thread of the sender. The
driver and the ranks use bytes instead: every message is one pickle holding its tensors'
data, taken when it is sent. A message is then a snapshot (a rank may send its live
weights; a later step cannot change what the driver got), nothing stays shared between the
processes, and no thread of the sender has to outlive the call. It costs a copy of the
data; a weight sync of the tiny model stays well under a millisecond of it.

One run of the suite under pytest-xdist saw a rank abort during ``full_state_dict`` with
glibc's ``corrupted size vs. prev_size`` while its weights went through shared memory; this
module is the change made for it (whether that path was the cause was not established).
"""

from __future__ import annotations

import pickle
from typing import Any


def encode(message: Any) -> bytes:
    """``message`` as one pickle, its tensors' data inside it."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    """The message ``encode`` made, with tensors of its own (shared with no process)."""
    return pickle.loads(data)  # our own ranks' bytes, over a private pipe
