"""LoRA adapters on a transformers causal LM, through peft, without changing the model's type.

``add_lora`` injects low-rank adapters into the model *in place* and freezes everything
else: the object stays a ``Qwen2ForCausalLM`` (or whichever class), so the learner's forward
passes, the torch sampler and the key/value cache code need no second path. What peft's
``PeftModel`` wrapper would add is done here with small functions:

- ``adapters_off``: the base policy, for the KL reference (no second copy of the model);
- ``save_adapters`` / ``load_adapters``: only the adapters go to disk (peft's file layout,
  ``adapter_config.json`` + ``adapter_model.safetensors``, loadable by peft itself);
- ``merged_state_dict``: the base model's parameter names with ``W + scale * B @ A`` in
  place of each adapted weight, which is what an inference engine (vLLM) is given, and what
  ``turnrl export`` writes; ``merge_adapters`` does the same to weights gathered whole from
  a sharded model's ranks, by the model's ``adapter_plan``.

peft is an optional dependency (the ``lora`` extra); it is imported only when LoRA is used.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from turnrl.errors import ConfigError

ADAPTER = "default"
"""The one adapter a turnrl model carries (peft's default name)."""

ADAPTER_CONFIG = "adapter_config.json"


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(
            "model.lora needs peft: pip install 'turnrl[lora]' (or pip install peft)"
        ) from exc
    return peft


def add_lora(
    model: Any,
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    dropout: float = 0.0,
    base_path: str | Path = "",
) -> Any:
    """Inject LoRA adapters of ``rank`` into ``model`` in place; only they stay trainable.

    ``target_modules``: module names to adapt (``q_proj``, ...) or ``["all-linear"]`` (every
    linear layer but the output head). ``alpha / rank`` scales the update. The adapters
    start as a no-op (B = 0), so the adapted model equals the base at step 0.
    ``base_path`` is recorded in the saved adapter config as the base model's directory.
    """
    peft = _peft()
    targets: str | list[str] = (
        "all-linear" if list(target_modules) == ["all-linear"] else list(target_modules)
    )
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    if base_path:  # peft records the model's own name_or_path as the adapters' base
        model.name_or_path = str(base_path)
    try:
        with warnings.catch_warnings():  # a tied adapted layer: refused below, more plainly
            warnings.filterwarnings("ignore", "Model has `tie_word_embeddings=True`")
            wrapped = peft.get_peft_model(model, config, adapter_name=ADAPTER)
    except ValueError as exc:  # e.g. a target module the model does not have
        raise ConfigError(f"model.lora: {exc}") from exc
    adapted: Any = wrapped.get_base_model()  # the same object, adapters injected
    _refuse_tied_adapters(adapted)
    return adapted


def _refuse_tied_adapters(model: Any) -> None:
    """``ConfigError`` if an adapted weight is shared with another module (an input
    embedding tied to the output layer): its adapter changes one use and not the other, so
    no merged model (what an engine samples from, what ``turnrl export`` writes) is the
    trained policy."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for layer in _tuner_layers(model):
        weight = getattr(layer.get_base_layer(), "weight", None)
        shared = names.get(id(weight), []) if weight is not None else []
        if len(shared) > 1:
            raise ConfigError(
                f"model.lora: {' and '.join(shared)} are one weight (tied), and an adapter "
                "on it would change only one of its uses: no merged model would be the "
                "trained policy. Leave that module out of model.lora.target_modules."
            )


def is_lora(model: Any) -> bool:
    """Whether ``model`` carries LoRA adapters (``add_lora`` or ``load_adapters``)."""
    return bool(getattr(model, "peft_config", None))


def _tuner_layers(model: Any) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_off(model: Any) -> Iterator[Any]:
    """``model`` as its base policy (adapters switched off) for the duration of the block.

    Score the reference before the policy's forward pass of a step, not between its
    forward and backward. peft's switch also sets the adapters' ``requires_grad`` to False
    and back to True; this keeps every parameter's flag as it was instead. Under FSDP2 the
    switch would otherwise land on whichever tensors are registered at the time (sharded
    before a forward, unsharded after one), leave the sharded adapters frozen, and a later
    forward that was not preceded by this block would carry no gradient."""
    layers = _tuner_layers(model)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    for p, flag in flags:
        p.requires_grad_(flag)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters an optimizer should hold: all of them, or only the adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def save_adapters(model: Any, directory: str | Path) -> None:
    """Write only the adapters (peft's layout) to ``directory``."""
    peft = _peft()
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    weights = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER)
    # peft's files name tensors from its wrapper: ``base_model.model.`` + the model's names
    tensors = {f"base_model.model.{k}": v.detach().contiguous() for k, v in weights.items()}
    save_file(tensors, out / "adapter_model.safetensors")
    model.peft_config[ADAPTER].save_pretrained(str(out))


def save_model(model: Any, directory: str | Path) -> None:
    """``save_pretrained`` for a plain model, only the adapters for a LoRA one."""
    if is_lora(model):
        save_adapters(model, directory)
    else:
        model.save_pretrained(directory)


def load_adapters(model: Any, directory: str | Path, *, trainable: bool = True) -> Any:
    """Put the adapters saved in ``directory`` into ``model`` (its base) in place."""
    peft = _peft()
    wrapped = peft.PeftModel.from_pretrained(
        model, str(directory), adapter_name=ADAPTER, is_trainable=trainable
    )
    loaded: Any = wrapped.get_base_model()
    return loaded


def merged(model: Any, directory: str | Path) -> Any:
    """``model`` (the base) with the adapters in ``directory`` merged into its weights: a
    plain model again, for inference and export."""
    peft = _peft()
    wrapped = peft.PeftModel.from_pretrained(model, str(directory), adapter_name=ADAPTER)
    return wrapped.merge_and_unload()


def adapter_base(directory: str | Path) -> Path:
    """The base model directory of the adapters in ``directory``: the one recorded in its
    config, or else a ``start_model`` beside the run that holds it (a run directory that was
    moved). Raises ``ConfigError`` naming both places when neither exists."""
    directory = Path(directory)
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    recorded = config.get("base_model_name_or_path") or ""
    if recorded and (Path(recorded) / "config.json").is_file():
        return Path(recorded)
    for parent in list(directory.resolve().parents)[:3]:
        if (parent / "start_model" / "config.json").is_file():
            return parent / "start_model"
    raise ConfigError(
        f"{directory} holds LoRA adapters, but their base model is not at {recorded!r} "
        "(recorded in adapter_config.json) nor in a start_model directory of the run "
        "around it"
    )


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapted weight merged (``W + scale * B @ A``),
    under the base model's parameter names; ``model`` itself is left unchanged."""
    with torch.no_grad():
        state = {k: v.detach() for k, v in model.state_dict().items()}
    return merge_adapters(state, adapter_plan(model))


MergeStep = tuple[str, str, float, bool]
"""How one adapted weight is merged: the keys of its A and B, its scale, and whether
``B @ A`` is transposed to the weight's layout."""


def adapter_plan(model: Any) -> dict[str, MergeStep]:
    """For each adapted weight of ``model`` (its state dict's key): how ``merge_adapters``
    merges it. Read from the adapter layers' own settings (peft's ``scaling``, and
    ``fan_in_fan_out`` for a layer that stores its weight transposed, as GPT-2's Conv1D
    does); a sharded model gives the same plan (the settings are not sharded)."""
    plan: dict[str, MergeStep] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if ADAPTER in getattr(module, "lora_A", {}):
            plan[f"{prefix}base_layer.weight"] = (
                f"{prefix}lora_A.{ADAPTER}.weight", f"{prefix}lora_B.{ADAPTER}.weight",
                float(module.scaling[ADAPTER]), bool(getattr(module, "fan_in_fan_out", False)),
            )  # fmt: skip
        elif ADAPTER in getattr(module, "lora_embedding_A", {}):  # an embedding's: (V, H)
            plan[f"{prefix}base_layer.weight"] = (
                f"{prefix}lora_embedding_A.{ADAPTER}", f"{prefix}lora_embedding_B.{ADAPTER}",
                float(module.scaling[ADAPTER]), True,
            )  # fmt: skip
    return plan


def merge_adapters(
    state: dict[str, torch.Tensor], plan: dict[str, MergeStep]
) -> dict[str, torch.Tensor]:
    """``state`` (a LoRA model's state dict, or its weights gathered whole from shards)
    as the base model's: each weight in ``plan`` plus ``scale * B @ A`` (in float32 where
    the weights are half precision), the adapters dropped, the base model's names. Raises
    ``ValueError`` for an adapter the plan does not cover (it would be lost silently)."""
    out: dict[str, torch.Tensor] = {}
    covered = {key for a, b, _, _ in plan.values() for key in (a, b)}
    with torch.no_grad():
        for key, value in state.items():
            if ".lora_" in key:
                if key not in covered:
                    raise ValueError(f"the LoRA weight {key} belongs to no adapted weight")
                continue
            if key in plan:
                a, b, scale, transposed = plan[key]
                wide = torch.float32 if value.dtype in (torch.float16, torch.bfloat16) else None
                product = state[b].to(wide) @ state[a].to(wide) if wide else state[b] @ state[a]
                delta = (product.T if transposed else product) * scale
                value = value + delta.to(value.dtype)
            out[key.replace(".base_layer.", ".")] = value
    return out
