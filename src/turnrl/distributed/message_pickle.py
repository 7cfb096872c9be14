"""What the driver and its learner ranks send each other: plain pickles, tensors by value.

A ``multiprocessing`` queue or pipe pickles with torch's reducers, which move each tensor
through shared memory and pass its file descriptor from a helper thread of the sender. The
driver and the ranks use bytes instead: every message is one pickle holding its tensors'
data, taken when it is sent. A message is then a snapshot (a rank may send its live
weights; a later step cannot change what the driver got), nothing stays shared between the
processes, and no thread of the sender has to outlive the call.

A plain CPU tensor's data goes into the pickle as its raw bytes (a protocol-5 buffer) and
comes out into a buffer the received tensor keeps. torch's own pickling of a tensor wraps a
``torch.save`` of its storage, loaded back with ``torch.load``: more copies. Measured on
this machine (2026-11-28) for a 110M-parameter model's weights (453 MB): 0.23 s to encode
and 0.17 s to decode, against torch's 0.37 s and 0.33 s (the pipe itself: 0.5 s); a
weight gather from 2 ranks into the driver's model took 0.78x the time with torch's
pickling (6 interleaved rounds; 3.7M parameters: 0.81x). Any other tensor (a GPU tensor,
a ``Parameter``, a DTensor, a sparse or quantised one) keeps torch's pickling.

One run of the suite under pytest-xdist saw a rank abort during ``full_state_dict`` with
glibc's ``corrupted size vs. prev_size`` while its weights went through shared memory; this
module is the change made for it (whether that path was the cause was not established).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch


class _Pickler(pickle.Pickler):
    """A pickler that writes a plain CPU tensor as its dtype, shape and raw bytes."""

    def reducer_override(self, obj: Any) -> Any:
        if not _plain(obj):
            return NotImplemented
        data = obj.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        raw = data.view(torch.uint8).numpy() if data.numel() else None
        buffer = pickle.PickleBuffer(raw) if raw is not None else b""
        return _tensor, (str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                         obj.requires_grad, buffer)  # fmt: skip


def _plain(obj: Any) -> bool:
    return (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.is_quantized
    )


def _tensor(dtype: str, shape: tuple[int, ...], requires_grad: bool, data: Any) -> torch.Tensor:
    """The tensor ``_Pickler`` wrote; its memory is ``data``'s (a bytearray the unpickler
    made for it: writable, owned by no one else)."""
    kind = getattr(torch, dtype)
    if len(data) == 0:
        out = torch.empty(shape, dtype=kind)
    else:
        out = torch.frombuffer(data, dtype=torch.uint8).view(kind).reshape(shape)
    return out.requires_grad_(requires_grad) if requires_grad else out


def encode(message: Any) -> bytes:
    """``message`` as one pickle, its tensors' data inside it."""
    stream = io.BytesIO()
    _Pickler(stream, protocol=5).dump(message)
    return stream.getvalue()


def decode(data: bytes) -> Any:
    """The message ``encode`` made, with tensors of its own (shared with no process)."""
    return pickle.loads(data)  # our own ranks' bytes, over a private pipe
