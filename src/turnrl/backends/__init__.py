"""Engines: what samples completions for the rollout (the ``Backend`` protocol of
``turnrl.protocols``). ``TorchBackend`` samples from a model held in this process (the CPU
default); ``VLLMBackend`` from a model directory with a vLLM engine in this process. Both
take ``GenerationRequest``s and answer ``Completion``s. For writing your own loop or
benchmark; ``turnrl.train`` builds the engine ``rollout.backend`` names. Each name is
imported when first used (torch, and vLLM for ``VLLMBackend``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl._lazy import lazy_attribute

if TYPE_CHECKING:
    from turnrl.backends.torch_backend import TorchBackend
    from turnrl.backends.vllm_backend import VLLMBackend, import_vllm
    from turnrl.types import Completion, GenerationRequest

__all__ = [
    "Completion",
    "GenerationRequest",
    "TorchBackend",
    "VLLMBackend",
    "import_vllm",
]

_LAZY = {  # name -> module: imported when first asked for
    "TorchBackend": "turnrl.backends.torch_backend",
    "VLLMBackend": "turnrl.backends.vllm_backend",
    "import_vllm": "turnrl.backends.vllm_backend",
    "Completion": "turnrl.types",
    "GenerationRequest": "turnrl.types",
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, globals(), name)
