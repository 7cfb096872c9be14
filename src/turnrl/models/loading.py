"""Loading a tokenizer and a causal LM by directory or hub id, with errors that say what to do.

Every model, the embedded tiny one included, goes through ``AutoTokenizer`` and
``AutoModelForCausalLM``: a Qwen2.5 instruct model in a local directory loads exactly like a
directory written by ``build_tiny_model``. A hub id is looked up in the local hub cache
first, then on the hub (when the hub is not switched off with ``HF_HUB_OFFLINE``). A GGUF
file, a directory holding one, or a named model (``gguf.NAMED_MODELS``) loads as the
checkpoint imported from it (``gguf.resolve_model``).

What does not live here: building the tiny model (``tiny.py``) and generation (backends).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import huggingface_hub
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from turnrl.errors import ConfigError, TemplateError
from turnrl.models.gguf import resolve_model
from turnrl.models.lora import ADAPTER_CONFIG, adapter_base, merged

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_HUB_ID = re.compile(r"^[A-Za-z0-9_-][\w.-]*(/[\w.-]+)?$")
"""``name`` or ``owner/name``: what may be a hub id rather than a filesystem path."""

_BUILD_HINT = "To build a small local model instead, run `turnrl init-model DIR` and pass DIR."


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory or hub id, checked for what turnrl needs.

    Raises ``TemplateError`` if it has no chat template (turnrl renders every conversation
    through it). A tokenizer without a pad token gets its end-of-sequence token as pad.
    """
    name_or_path = resolve_model(name_or_path, say=logger.info)
    tokenizer: PreTrainedTokenizerBase = _load(
        AutoTokenizer.from_pretrained, name_or_path, "tokenizer", {}
    )
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(
            f"the tokenizer of {name_or_path} has no chat template; turnrl renders every "
            "conversation with one (use an instruct/chat model, or set "
            "tokenizer.chat_template to a Jinja template)"
        )
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention: str = "auto",
) -> PreTrainedModel:
    """The causal LM of a model directory or hub id, in eval mode on ``device``. A
    directory of LoRA adapters (a LoRA run's checkpoint) loads as its base model with the
    adapters merged.

    ``dtype=None`` means float32 on CPU (half precision is slow there and its rounding
    would make CPU runs differ from the reference math) and the checkpoint's own dtype on
    an accelerator. ``attention``: transformers' ``attn_implementation`` (``auto`` leaves
    transformers' default).
    """
    name_or_path = resolve_model(name_or_path, say=logger.info)
    adapters = Path(str(name_or_path)).expanduser()
    if (adapters / ADAPTER_CONFIG).is_file():  # LoRA adapters: their base, merged
        base = load_model(adapter_base(adapters), dtype=dtype, device=device, attention=attention)
        with_adapters: PreTrainedModel = merged(base, adapters).eval()
        return with_adapters
    device = torch.device(device)
    if dtype is None:
        chosen: torch.dtype | str = torch.float32 if device.type == "cpu" else "auto"
    else:
        chosen = dtype
    options: dict[str, Any] = {"dtype": chosen}
    if attention != "auto":
        options["attn_implementation"] = attention
    model: Any = _load(AutoModelForCausalLM.from_pretrained, name_or_path, "model", options)
    loaded: PreTrainedModel = model.to(device).eval()
    return loaded


_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
"""Tokens that end a turn in the families turnrl knows: ChatML's (Qwen) and Llama 3.1's
(which its checkpoints list as end-of-sequence ids besides the tokenizer's own)."""


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The token ids that end an assistant turn: end-of-sequence, then those of
    ``_END_TOKENS`` the vocabulary has, without duplicates, in that order."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.append(eos)
    vocab = tokenizer.get_vocab()
    for token in _END_TOKENS:
        token_id = vocab.get(token)
        if isinstance(token_id, int) and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def _load(
    loader: Callable[..., _T], name_or_path: str | Path, what: str, kwargs: dict[str, Any]
) -> _T:
    """Call ``loader`` on a local directory or a hub id; failures become ``ConfigError``."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        try:
            return loader(str(path), **kwargs)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{path} is a directory but no {what} could be loaded from it ({exc}). "
                f"{_BUILD_HINT}"
            ) from exc
    if isinstance(name_or_path, Path) or not _HUB_ID.match(name):
        raise ConfigError(
            f"no {what} at {path}: that directory does not exist (tried it as a local "
            "path; it is not a hub id, and there is no network to a model hub here anyway). "
            f"{_BUILD_HINT}"
        )
    try:
        return loader(name, local_files_only=True, **kwargs)
    except (OSError, ValueError):
        pass
    if _hub_offline():
        raise ConfigError(
            f"cannot load {what} {name!r}: tried the local directory ./{name} (absent) and "
            "the hub cache (not there); the model hub is switched off (HF_HUB_OFFLINE) and "
            f"there is no network to a model hub here. {_BUILD_HINT}"
        )
    try:
        return loader(name, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load {what} {name!r}: tried the local directory ./{name} (absent), the "
            f"hub cache (not there) and the model hub ({exc}). Without network to a model "
            f"hub, only local directories load. {_BUILD_HINT}"
        ) from exc


def _hub_offline() -> bool:
    """Whether hub downloads are switched off (``HF_HUB_OFFLINE``)."""
    return bool(huggingface_hub.is_offline_mode())
