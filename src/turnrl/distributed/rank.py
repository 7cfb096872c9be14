"""One rank of a ``LearnerGroup``: a process that holds a shard of the model under FSDP2
and runs the in-process learner's update on its shard of each batch.

What lives here: the rank's process (set-up, then a loop answering the driver's calls),
``ShardedLearner`` (the ``Learner`` with the batch's normalisers and metrics taken over all
ranks) and the view of the FSDP2 model that the learner's forward code calls. The loss,
the reductions and the optimizer step are the ``Learner``'s own (trainer/learner.py);
nothing of the math is repeated here. The driver side is learner_group.py.

How the model is sharded (``cluster.fsdp_unit``). FSDP2 gathers a unit's parameters in
the unit's forward hook and reduces its gradients after its backward, so every rank must
run the same sequence of unit calls, whatever its rows. Every rank runs the same number
of micro-batches (empty ones are added where a rank has fewer), and each call of
``base_model`` by the learner's forward code (trainer/forward.py) goes through the root's
forward (``RootCall``), whose gathered parameters (the final norm, and the embeddings and
output layer unless they are units of their own) stay gathered until its backward.
- ``"layer"`` (the default): each decoder layer is a unit of its own (the classes the
  model lists as ``_no_split_modules``), gathered for its forward, sharded again after it,
  gathered again for its backward. So are the input and output embeddings where they are
  separate weights (``untied_embeddings``). A rank holds one layer whole at a time besides
  the root's parameters: what lets a model larger than one device's memory train. Whether
  the forward code runs a common prefix apart (two calls of the base model, not one)
  depends on each rank's rows, so the ranks agree on it before each forward (the
  smallest prefix over the ranks: ``forward.agreed_prefix``): a prefix is run apart only
  where every rank has one.
- ``"model"``: the whole model is one unit, gathered once per micro-batch: fewer, larger
  collectives, and a rank holds every parameter while it computes (sharded at rest only:
  parameters, gradients and optimizer state, ZeRO-3-like between steps). The forward code
  may then run a shared prefix apart: a second call in the same micro-batch gathers nothing.
Passes without gradients whose calls depend on the data (the sampler gap, a KL in the
reward, the critic's values) run with every unit gathered once first (``gathered``).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import math
import os
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from turnrl.backends.hf_cache import cache_kwargs, returned_cache
from turnrl.distributed import message_pickle
from turnrl.models import load_model
from turnrl.models.lora import is_lora
from turnrl.rollout.batch import Batch
from turnrl.trainer.config import AlgorithmConfig
from turnrl.trainer.critic import Critic
from turnrl.trainer.learner import Learner, Norms
from turnrl.trainer.startup import checkpoint_activations
from turnrl.types import Sample

ModelSource = str | Path | Callable[[], Any]
"""A model directory (loaded with ``turnrl.models.load_model``) or a picklable function
returning the model (each rank calls it: it must give every rank the same weights)."""

SUMMED = ("loss/policy", "loss/kl")
"""Metrics each rank computes as its part of the whole batch's value (the global
normaliser is already in them): summed over ranks. Of the others, a name ending ``_max``
or ``_min`` is an extreme over ranks, one under ``off_policy/seq_`` a mean over
sequences, and the rest means over tokens (``combined_metrics``)."""
SAME = ("train/grad_norm",)
"""Already global: the gradient norm over the sharded gradients of all ranks."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to start, sent by the driver."""

    model: ModelSource
    config: AlgorithmConfig
    temperature: float
    max_length: int
    device: str  # "cpu" or "cuda"
    autocast: torch.dtype | None
    seed: int
    num_threads: int  # torch's threads on this rank; 0: torch's default
    collective_timeout_s: float
    checkpoint_activations: bool = False  # model.gradient_checkpointing
    fsdp_unit: str = "layer"  # cluster.fsdp_unit: "layer" or "model"


class RootCall:
    """The FSDP2 model as the learner's forward code sees it: ``base_model(...)`` runs the
    whole model's forward (so FSDP2's hooks gather and reduce), with the output layer on
    only the last position (``logits_to_keep=1``: almost free), or not at all where it is a
    unit of its own (it would be gathered for nothing), and returns the base model's last
    hidden states; every other attribute is the model's own."""

    def __init__(self, root: Any) -> None:
        self._root = root
        self.base_model = _BaseThroughRoot(root)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._root, name)

    def eval(self) -> RootCall:
        self._root.eval()
        return self

    def requires_grad_(self, requires_grad: bool = True) -> RootCall:
        self._root.requires_grad_(requires_grad)
        return self


@dataclass(frozen=True)
class _BaseOutput:
    last_hidden_state: torch.Tensor
    cache: Any


class _BaseThroughRoot:
    """``RootCall.base_model``: a call of the base model made through the root's forward."""

    def __init__(self, root: Any) -> None:
        self._root = root
        several = dist.is_initialized() and dist.get_world_size() > 1
        if several and any(_is_unit(m) for name, m in root.named_modules() if name):
            # Layers are units of their own, gathered at every call: the ranks agree on
            # the calls (forward.agreed_prefix). One rank may make any: it runs the
            # in-process learner's forward exactly.
            self.agree_on_prefix = self._smallest_over_ranks
        head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
        self._head = head if head is not None and head is not root and _is_unit(head) else None
        """The output layer where it is a unit of its own (untied embeddings, layer units):
        the root's calls leave it out (``_without_head``)."""
        self._initialised = False
        """Whether the root has run a forward (FSDP2's lazy set-up, which finds the units
        among the root's modules, is done: the head may be taken out)."""

    def _smallest_over_ranks(self, shared: int) -> int:
        """The smallest ``shared`` of all ranks (a collective: every rank calls it); inside
        ``gathered`` this rank's own (every unit is whole: calls gather nothing)."""
        if self._root in _GATHERED:
            return shared
        device = next(self._root.parameters()).device
        value = torch.tensor([shared], dtype=torch.long, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value)

    @property
    def gradient_checkpointing(self) -> bool:
        return bool(getattr(self._root.base_model, "gradient_checkpointing", False))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: Any = None,
    ) -> _BaseOutput:
        """Declared with ``cache``, so ``hf_cache.cache_kwargs`` passes the cache by that
        name; it is handed on in the spelling the model's own class declares."""
        extra = cache_kwargs(self._root.base_model, cache) if cache is not None else {}
        with self._without_head():
            out = self._root(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=use_cache, output_hidden_states=True, logits_to_keep=1, **extra,
            )  # fmt: skip
        self._initialised = True
        # The last hidden state is an output of the root's forward: FSDP2's backward hook
        # on the root's outputs fires from it (the logits are not used).
        cache_out = returned_cache(out) if use_cache else None
        return _BaseOutput(last_hidden_state=out.hidden_states[-1], cache=cache_out)

    __call__ = forward

    @contextlib.contextmanager
    def _without_head(self) -> Iterator[None]:
        """The root's forward with its output layer, a unit of its own, replaced by
        ``_NoLogits``: the root's call would gather the whole output layer (V x H, a
        billion parameters at Qwen2.5-7B's) for the last position's logits, which nothing
        uses, and the forward code's call on the trained positions gathers it again. Not on
        the root's first call: FSDP2's lazy set-up looks for the units among the root's
        modules then, and must find the output layer there."""
        head = self._head
        if head is None or not self._initialised:
            yield
            return
        self._root.set_output_embeddings(_NoLogits())
        try:
            yield
        finally:
            self._root.set_output_embeddings(head)


class _NoLogits(torch.nn.Module):
    """Stands in for the output layer in the root's own call: logits of no vocabulary
    entries, computed from nothing (``_BaseThroughRoot._without_head``)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros((*hidden.shape[:-1], 0))


class ShardedLearner(Learner):
    """The ``Learner`` on one rank's shard of a batch: the loss is normalised by the whole
    batch's token and sequence counts (summed over ranks), FSDP2 sums the gradients over
    ranks (no averaging), so the update equals the one-process update; the metrics are
    combined over ranks to the values one process would report.

    PPO's critic (``advantage = "gae"``) is a ``ShardedCritic``: its value head replicated
    on every rank (its gradients summed over ranks), its trunk the policy itself
    (``placement = "head"``) or ``critic_trunk``, a second FSDP2 model (``"model"``). GAE
    runs on each rank's own samples (it is per sample); the whitening of the advantages,
    the critic's loss normaliser and its metrics take the whole batch's statistics."""

    def __init__(
        self,
        root: Any,
        config: AlgorithmConfig,
        critic_trunk: Any = None,
        reference: Any = None,
        **kwargs: Any,
    ) -> None:
        self.root = root
        self.critic_root = critic_trunk if critic_trunk is not None else root
        """The FSDP2 model the critic's values are computed through."""
        self.reference_root = reference
        """The KL reference, an FSDP2 model sharded as the policy is (None: no KL, or the
        LoRA base)."""
        self.frozen_whole: dict[str, torch.Tensor] | None = None
        """The weights that do not train (a LoRA policy's base), whole, as a weight sync
        from the ranks last gathered them (ranks_to_workers.py; rank 0 holds them, other
        ranks an empty dict); None until then, and again after any load of weights."""
        self.kept_sync: tuple[int, dict[str, torch.Tensor]] | None = None
        """In an asynchronous run, on rank 0: the last sync it sent to the rollout workers
        (its number, and the weights that change: a LoRA policy's adapters, any other
        policy's whole weights), kept for a worker replaced while the ranks run the next
        update (ranks_to_workers.py); None until then, and again after any load."""
        self._norms: Norms | None = None
        ref = RootCall(reference) if reference is not None else None
        super().__init__(RootCall(root), config, reference=ref, **kwargs)

    def make_critic(self, model: Any, config: AlgorithmConfig) -> ShardedCritic:
        trunk = RootCall(self.critic_root) if self.critic_root is not self.root else None
        return ShardedCritic(model, config, trunk=trunk)

    def critic_values(self, chunks: Sequence[Batch]) -> list[torch.Tensor]:
        """Values with the critic's parameters gathered once: ranks with more micro-batches
        than others run no collectives of their own."""
        values = super().critic_values
        return list(gathered(self.critic_root, lambda: values(chunks)))

    def whiten(
        self, values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``masked_whiten`` with the whole batch's mean and (N-1) std, summed over ranks."""
        return whitened_across_ranks(values, masks, self.device)

    def value_mean(self, values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> float:
        parts = [
            sum(float(v[m].sum()) for v, m in zip(values, masks, strict=True)),
            sum(float(m.sum()) for m in masks),
        ]
        total, count = all_summed(parts, self.device)
        return total / (count or 1.0)

    def critic_step(
        self,
        chunks: Sequence[Batch],
        returns: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> dict[str, float]:
        """``Critic.step`` on this rank's micro-batches with the whole batch's token count;
        the metrics summed over ranks (each rank's are its part of the whole). A separate
        value model runs FSDP2's collectives in every forward and backward, so every rank
        runs as many micro-batches (empty ones added); a head on the policy reads hidden
        states computed without gradients, with the policy gathered once."""
        assert self.critic is not None
        critic = self.critic
        micro, rets, olds = list(chunks), list(returns), list(values)
        (num_tokens,) = all_summed([sum(float(mb.loss_mask.sum()) for mb in micro)], self.device)
        count = torch.tensor([len(micro)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        pad = empty_batch(self.device)
        for _ in range(int(count) - len(micro)):
            micro.append(pad)
            rets.append(torch.zeros(pad.input_ids.shape, device=self.device))
            olds.append(torch.zeros(pad.input_ids.shape, device=self.device))
        total = torch.tensor(max(num_tokens, 1.0), device=self.device)

        def step() -> dict[str, float]:
            with self.autocasting():
                return critic.step(micro, rets, olds, num_tokens=total)

        local = step() if self.critic_root is not self.root else gathered(self.root, step)
        keys = sorted(local)
        return dict(zip(keys, all_summed([local[k] for k in keys], self.device), strict=True))

    def step(self, batch: Batch | Sequence[Batch]) -> dict[str, float]:
        """``Learner.step`` on this rank's shard (``batch``: rows to cut into micro-batches,
        or micro-batches; either may be empty), with the global normalisers; the metrics
        are the whole batch's, the same on every rank."""
        micro = self.micro_batches(batch)
        tokens = sum(float(mb.loss_mask.sum()) for mb in micro)
        sequences = sum(float(mb.loss_mask.any(-1).sum()) for mb in micro)
        counts = torch.tensor(
            [tokens, sequences, float(sum(mb.num_sequences for mb in micro))],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(counts)
        num_micro = torch.tensor([len(micro)], device=self.device)
        dist.all_reduce(num_micro, op=dist.ReduceOp.MAX)
        # Empty micro-batches (nothing to learn from: zero gradient) keep the ranks'
        # collectives in step.
        micro += [empty_batch(self.device)] * (int(num_micro) - len(micro))
        num_tokens = counts[0].clamp(min=1).float()
        self._norms = (num_tokens, counts[1].clamp(min=1).float())
        try:
            local = super().step(micro)
        finally:
            self._norms = None
        return combined_metrics(local, tokens, sequences, counts, self.device)

    def _reference_logprobs(self, mb: Batch) -> torch.Tensor | None:
        """The learner's, then the reference's root sharded again: FSDP2 keeps a root's
        parameters after its forward for the backward, which a frozen model never runs."""
        try:
            return super()._reference_logprobs(mb)
        finally:
            if self.reference_root is not None:
                self.reference_root.reshard()

    def _reduce(self, per_token: torch.Tensor, mask: torch.Tensor, norms: Norms) -> torch.Tensor:
        """The learner's reduction with the whole batch's normalisers, not this rank's."""
        return super()._reduce(per_token, mask, self._norms if self._norms is not None else norms)


class ShardedCritic(Critic):
    """The ``Critic`` on a rank: its head's gradients are summed over ranks before the
    joint clip (they are each rank's part of the whole batch's); a sharded trunk's
    gradients already are (FSDP2's reduce-scatter), so their norm is gathered from the
    shards for the joint norm the one-process critic clips by."""

    def clip_gradients(self) -> None:
        head = [p.grad for p in self.head.parameters() if p.grad is not None]
        for grad in head:
            dist.all_reduce(grad)
        if self.shared:
            super().clip_gradients()
            return
        trunk = [p.grad for p in self.trunk.parameters() if p.grad is not None]
        squares = [float(torch.nn.utils.get_total_norm(head)) ** 2 if head else 0.0]
        if trunk:
            norm = torch.nn.utils.get_total_norm(trunk)
            full = norm.full_tensor() if isinstance(norm, DTensor) else norm
            squares.append(float(full) ** 2)
        # torch.nn.utils.clip_grad_norm_'s rule, over both
        coefficient = min(1.0, self.config.max_grad_norm / (sum(squares) ** 0.5 + 1e-6))
        with torch.no_grad():
            for grad in [*head, *trunk]:
                grad.mul_(coefficient)


def whitened_across_ranks(
    values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """``algorithms.masked_whiten`` over the valid entries of every rank's ``values``: the
    whole batch's mean, its (N-1) std, exactly 0 where every valid value is equal."""
    flat = torch.cat([v[m] for v, m in zip(values, masks, strict=True)]) if values else None
    local = flat if flat is not None else torch.zeros(0, device=device)
    count, total = all_summed([float(local.numel()), float(local.double().sum())], device)
    extremes = torch.tensor(
        [float(local.max()) if local.numel() else -math.inf,
         -float(local.min()) if local.numel() else -math.inf],
        dtype=torch.float64, device=device,
    )  # fmt: skip
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    mean = total / max(count, 1.0)
    (squares,) = all_summed([float((local.double() - mean).square().sum())], device)
    std = (squares / max(count - 1.0, 1.0)) ** 0.5
    flat_batch = not float(extremes[0]) > -float(extremes[1])
    out = []
    for v, m in zip(values, masks, strict=True):
        piece = torch.zeros_like(v)
        if not flat_batch:
            piece[m] = ((v[m].double() - mean) / (std + 1e-8)).to(v.dtype)
        out.append(piece)
    return out


def all_summed(values: Sequence[float], device: torch.device) -> list[float]:
    """``values`` summed over every rank (float64)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return [float(v) for v in tensor.tolist()]


def empty_batch(device: torch.device) -> Batch:
    """One row of two padding tokens with nothing to learn from (loss mask 0)."""
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    zeros = torch.zeros((1, 2), device=device)
    return Batch(ids, torch.ones_like(ids), ids.bool(), zeros, zeros)


def combined_metrics(
    local: dict[str, float],
    local_tokens: float,
    local_sequences: float,
    counts: torch.Tensor,
    device: torch.device,
) -> dict[str, float]:
    """The step's metrics over all ranks, as one process would report them: parts of the
    loss summed, the grad norm as it is (global), extremes (``_max``, ``_min``) the
    extremes of the ranks that had sampled tokens (0 if none had), means over sequences
    (``off_policy/seq_``) weighted by each rank's sequences with sampled tokens, and the
    rest (means over this rank's sampled tokens) weighted by each rank's tokens.
    ``counts``: the batch's tokens, sequences with tokens, and rows, over all ranks."""
    num_tokens, num_sequences = float(counts[0].clamp(min=1)), float(counts[1].clamp(min=1))
    rest = [k for k in local if k not in (*SUMMED, *SAME) and "/num_" not in k]
    maxed = sorted(k for k in rest if k.endswith("_max"))
    minned = sorted(k for k in rest if k.endswith("_min"))
    keys = sorted(k for k in rest if k not in (*maxed, *minned))
    summed = [local[k] for k in SUMMED] + [
        local[k] * (local_sequences / num_sequences if k.startswith("off_policy/seq_")
                    else local_tokens / num_tokens)
        for k in keys
    ]  # fmt: skip
    sums = torch.tensor(summed, dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    out = dict(local)
    out.update(zip([*SUMMED, *keys], sums.tolist(), strict=True))
    # A rank without sampled tokens has no extreme: the identity of the reduction instead.
    for names, op, identity in ((maxed, dist.ReduceOp.MAX, -math.inf),
                                (minned, dist.ReduceOp.MIN, math.inf)):  # fmt: skip
        if not names:  # the same names on every rank: all skip, or none does
            continue
        values = [local[k] if local_tokens > 0 else identity for k in names]
        extremes = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(extremes, op=op)
        reduced = zip(names, extremes.tolist(), strict=True)
        out.update((k, 0.0 if math.isinf(v) else v) for k, v in reduced)
    out["train/num_tokens"] = float(counts[0])
    out["train/num_sequences"] = float(counts[2])
    return out


# ----------------------------------------------------------------------- the rank process


def build_learner(spec: RankSpec, world: int, device_index: int = 0) -> ShardedLearner:
    """This rank's model under FSDP2 (``spec.fsdp_unit``'s units, gradients summed over
    ranks) and its learner; with a KL, a frozen reference loaded and sharded the same way
    (with LoRA the reference is the base: the policy with its adapters off)."""
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", device_index) if spec.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    c = spec.config
    model = load(spec.model).to(device)
    # With LoRA the reference is the base: the policy with its adapters off, as in process.
    reference = load(spec.model).to(device) if c.kl.coef > 0 and not is_lora(model) else None
    mesh = init_device_mesh(device.type, (world,))
    trunk = None  # PPO's separate value model: the start policy, sharded the same way
    if c.advantage == "gae" and c.critic.placement == "model":
        trunk = load(spec.model).to(device)
    for trained in (model, trunk):
        if trained is not None:
            if spec.checkpoint_activations:  # as in process: recomputed in the backward
                checkpoint_activations(trained)
            sharded(trained, mesh, spec.fsdp_unit)
    if reference is not None:  # frozen, sharded like the policy: one layer whole at a time
        sharded(reference.eval().requires_grad_(False), mesh, spec.fsdp_unit)
    return ShardedLearner(
        model, c, critic_trunk=trunk, temperature=spec.temperature, reference=reference,
        max_length=spec.max_length, autocast=spec.autocast,
    )  # fmt: skip


def sharded(model: Any, mesh: Any, unit: str = "layer") -> Any:
    """``model`` under FSDP2 on ``mesh``, its gradients summed over ranks: each decoder
    layer a unit, untied input and output embeddings units too, and the rest the root's
    (``unit="layer"``), or the whole model one unit (``"model"``)."""
    from torch.distributed.fsdp import fully_shard

    if unit not in ("layer", "model"):
        raise ValueError(f"fsdp unit must be 'layer' or 'model', got {unit!r}")
    if unit == "layer":
        for layer in decoder_layers(model) + untied_embeddings(model):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in fsdp_units(model):  # per unit: neither setting recurses
        # Each rank's loss already carries the whole batch's normaliser: sum, do not
        # average. (Sum-only reductions: gloo has no pre-multiplied sum.)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model


def decoder_layers(model: Any) -> list[Any]:
    """The modules of ``model`` whose class it names in ``_no_split_modules`` (transformers'
    list of the blocks that must stay whole: the decoder layers), outermost only."""
    names = set(_no_split_modules(model))
    found: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer, _ in found)
        # by the classes it derives from: fully_shard makes a subclass (FSDP<name>)
        named = any(c.__name__ in names for c in type(module).__mro__)
        if named and not inside:
            found.append((name, module))
    if not found:
        raise ValueError(
            f"cannot shard {type(model).__name__} layer by layer: it names no decoder "
            "layer class (transformers' _no_split_modules); set cluster.fsdp_unit = 'model'"
        )
    return [module for _, module in found]


def untied_embeddings(model: Any) -> list[Any]:
    """``model``'s input and output embeddings when they are separate weights (from 7B in
    Qwen2.5: a billion parameters at a 152k vocabulary), else none. As units of their own
    a rank holds each whole only while it computes; as the root's, from the forward to the
    backward. The root's own call leaves the output layer out (``RootCall``): it is
    gathered for the forward code's call on the trained positions only. A tied weight
    stays the root's: one parameter cannot belong to two units."""
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    inp = get_input() if get_input is not None else None
    out = get_output() if get_output is not None else None
    if inp is None or out is None or out.weight is inp.weight:
        return []
    return [inp, out]


def _no_split_modules(model: Any) -> list[str]:
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return list(names)
    return []


def _is_unit(module: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def fsdp_units(model: Any) -> list[Any]:
    """``model``'s FSDP2 units, the root first (the same order on every rank)."""
    return [m for m in model.modules() if _is_unit(m)]


def load(source: ModelSource) -> Any:
    if callable(source):
        return source()
    return load_model(source)


def gathered(root: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` with every FSDP2 unit of ``root`` gathered once on every rank first (one
    collective per unit, the same on all ranks, whatever each then runs), kept gathered
    through ``fn``'s forwards, and sharded again after."""
    units = fsdp_units(root)
    inner = [m for m in units if m is not root]
    _GATHERED.append(root)
    try:
        for unit in inner:  # the root keeps its parameters after a forward anyway
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in units:
            unit.unshard()
        return fn()
    finally:
        _GATHERED.remove(root)
        for unit in units:
            unit.reshard()
        for unit in inner:
            unit.set_reshard_after_forward(True, recurse=False)


_GATHERED: list[Any] = []
"""The FSDP2 models ``gathered`` holds whole now (``in`` compares modules by identity)."""


def full_state_dict(learner: ShardedLearner, trainable: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0, on the CPU (other ranks: empty); with
    ``trainable``, only the weights that train (a LoRA policy's adapters: the rest is
    frozen and already known)."""
    return whole_weights(learner.root, trainable)


def whole_weights(root: Any, trainable: bool = False) -> dict[str, torch.Tensor]:
    """``root.state_dict()`` with each sharded weight made whole, on rank 0, as plain CPU
    tensors (other ranks: empty); tied weights stay one tensor under both names. With
    ``trainable``, only the parameters that require gradients.

    Each weight is gathered to rank 0 alone, one blocking ``dist.gather`` of the ranks'
    shards padded to one size, a weight at a time (a rank holds one whole weight at most).
    It replaces torch's ``get_model_state_dict``, whose gather goes through DTensor's
    asynchronous functional collectives. In that call a gloo rank died three times in
    this project's runs (a segmentation fault at the 43rd and at the 240th weight sync of
    two vLLM learning runs; glibc's heap-corruption abort once under pytest-xdist), and
    never in 3,500 syncs run alone (steps between, the CPU idle or loaded). Whether that
    path was the cause is not established; this one has fewer moving parts, and a dead
    rank's stack is now quoted (learner_group.py)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = dict(root.state_dict(keep_vars=True))
    if trainable:
        state = {k: v for k, v in state.items() if getattr(v, "requires_grad", False)}
    whole = _whole_tree(state, rank, world, {})
    return cast(dict[str, torch.Tensor], whole) if rank == 0 else {}


def _whole(value: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``value`` whole on rank 0, a CPU copy (other ranks: an empty tensor). A DTensor
    sharded on its first dimension (FSDP2's layout: ``torch.chunk``'s pieces, the last
    ones possibly short or empty) is gathered; any other DTensor is made whole by torch."""
    if not isinstance(value, DTensor):
        return value.detach().to("cpu", copy=True) if rank == 0 else torch.empty(0)
    mesh = value.device_mesh
    shard = cast(DTensor, value.detach())
    if mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
        whole = shard.full_tensor()
        return whole.to("cpu", copy=True) if rank == 0 else torch.empty(0)
    local = shard.to_local()
    rows = value.shape[0]
    per = -(-rows // world)  # torch.chunk's piece size
    padded = local.new_zeros((per, *value.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, parts, dst=0, group=mesh.get_group())
    if parts is None:
        return torch.empty(0)
    sizes = [min(per, max(0, rows - r * per)) for r in range(world)]
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)]).cpu()


def state_dict(learner: ShardedLearner) -> dict[str, Any]:
    """Model and optimizer state, whole, on rank 0 (optimizer state keyed by parameter
    name), as CPU tensors; other ranks: empty.

    torch's ``get_state_dict`` gives each rank its shards (no collective), in the layout
    its ``full_state_dict`` option would give whole and ``set_state_dict`` loads; each
    sharded tensor is then made whole by ``_whole``, the weight sync's gather, rather than
    by that option's DTensor collectives, the path in which a rank died (``whole_weights``).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    fresh = not learner.optimizer.state
    model, optimizer = get_state_dict(
        learner.root, learner.optimizer, options=StateDictOptions(full_state_dict=False)
    )
    if fresh:
        # Reading the state of an optimizer that has not stepped makes its state (a zero
        # step taken, which changes Adam's next update): undo that, say it is fresh.
        learner.optimizer.state.clear()
        optimizer = {**optimizer, "state": {}}
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = _whole_tree({"model": model, "optimizer": optimizer}, rank, world, {})
    return cast(dict[str, Any], whole) if rank == 0 else {}


def _whole_tree(tree: Any, rank: int, world: int, seen: dict[int, torch.Tensor]) -> Any:
    """``tree`` (nested dicts and lists, as a state dict is) with every tensor made whole on
    rank 0 by ``_whole``, in the same order on every rank; a tensor met twice (tied
    weights) is gathered once and stays one tensor."""
    if isinstance(tree, torch.Tensor):
        if id(tree) not in seen:
            seen[id(tree)] = _whole(tree, rank, world)
        return seen[id(tree)]
    if isinstance(tree, dict):
        return {key: _whole_tree(value, rank, world, seen) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_whole_tree(value, rank, world, seen) for value in tree)
    return tree


def load_state_dict(learner: ShardedLearner, state: dict[str, Any]) -> None:
    """Load ``state_dict``'s output (every rank is given all of it, its own copy:
    message_pickle.py)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    options = StateDictOptions(full_state_dict=True)
    learner.frozen_whole = learner.kept_sync = None
    set_state_dict(
        learner.root, learner.optimizer, model_state_dict=state["model"],
        optim_state_dict=state["optimizer"], options=options,
    )  # fmt: skip
    if not state["optimizer"]["state"]:  # a fresh optimizer's: fresh again
        learner.optimizer.state.clear()


def load_weights(learner: ShardedLearner, weights: dict[str, torch.Tensor]) -> None:
    """Whole weights into this rank's shard of the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True)
    learner.frozen_whole = learner.kept_sync = None
    set_model_state_dict(learner.root, cast(dict[str, Any], weights), options=options)


def load_critic_weights(learner: ShardedLearner, weights: dict[str, torch.Tensor]) -> None:
    """Whole weights into this rank's shard of the separate value model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if learner.critic_root is learner.root:
        raise ValueError("the critic has no value model of its own (critic.placement = 'head')")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(learner.critic_root, cast(dict[str, Any], weights), options=options)


def critic_state_dict(learner: ShardedLearner) -> dict[str, Any]:
    """The critic's state whole, in the one-process ``Critic.state_dict`` layout (the head,
    its optimizer's state by parameter index and, for a separate value model, the trunk),
    on rank 0 (other ranks: empty): a resume with any number of ranks, 0 included, loads
    it. Sharded tensors are gathered as the weight sync gathers them (``whole_weights``)."""
    critic = learner.critic
    assert isinstance(critic, ShardedCritic)
    state = critic.state_dict() if critic.shared else {
        "head": critic.head.state_dict(), "optimizer": critic.optimizer.state_dict()
    }  # fmt: skip
    if not critic.shared:
        state["trunk"] = whole_weights(learner.critic_root)
    rank, world = dist.get_rank(), dist.get_world_size()
    state["optimizer"] = _whole_tree(state["optimizer"], rank, world, {})
    return state if rank == 0 else {}


def load_critic_state_dict(learner: ShardedLearner, state: dict[str, Any]) -> None:
    """Load ``critic_state_dict``'s layout (every rank is given all of it): each rank keeps
    its shard of a separate value model's weights and of their optimizer state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    critic = learner.critic
    assert isinstance(critic, ShardedCritic)
    critic.head.load_state_dict(state["head"])
    if not critic.shared:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(learner.critic_root, state["trunk"], options=options)
    params = [p for group in critic.optimizer.param_groups for p in group["params"]]
    optimizer = state["optimizer"]
    optimizer["state"] = {
        index: {k: _like(v, params[int(index)]) for k, v in values.items()}
        for index, values in optimizer["state"].items()
    }
    critic.optimizer.load_state_dict(optimizer)


def _like(value: Any, param: Any) -> Any:
    """An optimizer state tensor sharded as ``param`` is (a whole one for a DTensor
    parameter; scalars such as the step count as they are)."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value


def sampler_gap(learner: ShardedLearner, samples: Sequence[Sample], pad_id: int) -> float:
    return float(gathered(learner.root, lambda: learner.sampler_gap(samples, pad_id)))


def reference_kl(
    learner: ShardedLearner, samples: Sequence[Sample], pad_id: int
) -> list[list[float]]:
    # Every rank gathers a sharded reference, with samples or not; scoring then runs
    # no collectives of its own, however many micro-batches a rank has.
    # (learner.reference_root is None with LoRA: the base is the policy, adapters off)
    model = learner.reference_root if learner.reference_root is not None else learner.root
    kl: list[list[float]] = gathered(model, lambda: learner.reference_kl(samples, pad_id))
    return kl


COMMANDS: dict[str, Callable[..., Any]] = {
    "step": lambda learner, batch: learner.step(batch),
    "step_samples": lambda learner, samples, advantages, pad_id: learner.step_samples(
        samples, advantages, pad_id
    ),
    "step_samples_gae": lambda learner, samples, rewards, pad_id: learner.step_samples_gae(
        samples, rewards, pad_id
    ),
    "load_weights": lambda learner, weights: load_weights(learner, weights),
    "load_critic_weights": lambda learner, weights: load_critic_weights(learner, weights),
    "critic_state_dict": lambda learner: critic_state_dict(learner),
    "load_critic_state_dict": lambda learner, state: load_critic_state_dict(learner, state),
    "sampler_gap": sampler_gap,
    "reference_kl": reference_kl,
    "full_state_dict": full_state_dict,
    "state_dict": state_dict,
    "load_state_dict": load_state_dict,
    "call": lambda learner, fn, *args: fn(learner, *args),
}
"""What the driver may ask a rank: name -> fn(learner, *args)."""


def serve(
    rank: int,
    world: int,
    store_address: tuple[str, int],
    spec: RankSpec,
    commands: Any,
    answers: Connection,
    parent_pid: int,
    crash_file: str = "",
) -> None:
    """A rank's process: join the group, build the learner, answer the driver's calls
    (``commands``: (name, args) items; each answer is ("ok", value) or ("error", text))
    until ("close", ()) or until the driver is gone. ``crash_file``: where the Python stack
    of every thread goes if the process dies of a fatal signal (a segfault, an abort), for
    the driver to quote in its error."""
    if crash_file:
        report = open(crash_file, "w")  # noqa: SIM115 - held open until the process ends
        faulthandler.enable(file=report, all_threads=True)
    # A terminal's Ctrl-C reaches the driver's whole process group: the driver decides
    # (the step under way finishes and is saved, trainer/interrupt.py; or it closes us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid)
    try:
        learner = join_group(rank, world, store_address, spec, device_index=rank)
    except BaseException:
        answers.send_bytes(message_pickle.encode(("error", traceback.format_exc())))
        return
    answers.send_bytes(message_pickle.encode(("ok", None)))
    while True:
        try:
            payload = commands.get()
        except (EOFError, OSError):
            break
        name, args = message_pickle.decode(payload)
        if name == "close":
            break
        answers.send_bytes(answer(learner, name, args))
    dist.destroy_process_group()


def join_group(
    rank: int, world: int, store_address: tuple[str, int], spec: RankSpec, device_index: int
) -> ShardedLearner:
    """Set this process up as ``rank`` of ``world`` (torch's threads and seed, the process
    group through the driver's store at ``store_address``) and build its learner, on GPU
    ``device_index`` when ``spec.device`` is ``cuda``."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    torch.manual_seed(spec.seed)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    # FSDP2 warns once per process that the root returned a view: it is the embeddings'
    # output among transformers' hidden states, which nothing here reads (RootCall reads
    # the last), let alone changes in place. Every run's ranks printed it.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    host, port = store_address
    store = dist.TCPStore(host, port, is_master=False)  # type: ignore[attr-defined]
    dist.init_process_group(
        "nccl" if spec.device == "cuda" else "gloo", store=store, rank=rank,
        world_size=world, timeout=datetime.timedelta(seconds=spec.collective_timeout_s),
    )  # fmt: skip
    return build_learner(spec, world, device_index)


def answer(learner: ShardedLearner, name: str, args: Sequence[Any]) -> bytes:
    """The driver's call ``name(*args)`` run on this rank: ("ok", value) or ("error",
    the traceback), encoded for the driver (message_pickle.py)."""
    try:
        return message_pickle.encode(("ok", COMMANDS[name](learner, *args)))
    except BaseException:
        return message_pickle.encode(("error", traceback.format_exc()))


def _exit_with_parent(parent_pid: int) -> None:
    """Exit at once when the driver's process is gone (even mid-collective): a rank never
    outlives its group."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="turnrl-parent-watch").start()


__all__ = [
    "COMMANDS",
    "ModelSource",
    "RankSpec",
    "RootCall",
    "ShardedCritic",
    "ShardedLearner",
    "answer",
    "join_group",
    "serve",
]
