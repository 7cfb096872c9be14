"""The configuration's schema: frozen dataclasses, a docstring per field, each section
validating its own values when it is made.

Reading recipes and ``--set`` overrides into these is ``loading``; the ``auto`` choices are
made in ``resolution``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from turnrl.errors import ConfigError
from turnrl.trainer.config.help import HELP


def _require(checks: list[tuple[bool, str]]) -> None:
    """Raise the first failed check's message: every section validates itself when it is
    made, so a config built in Python is checked as one read from a recipe is."""
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (peft): train only them, keep the base frozen (``model.lora``).

    The KL reference is the base with its adapters switched off (no second model copy);
    checkpoints hold only the adapters; the sampler gets the merged weights;
    ``turnrl export`` writes a merged model."""

    rank: int = 0
    """Adapter rank r; 0 trains the whole model (no LoRA)."""
    alpha: float = 32.0
    """Scale numerator: the update is ``alpha / rank * B @ A``."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names to adapt (e.g. ``["q_proj", "v_proj"]``), or ``["all-linear"]``: every
    linear layer but the output head. A module whose weight is tied to another's (an input
    embedding that is also the output layer) is refused."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.rank >= 0, "model.lora.rank must be >= 0"),
                (self.alpha > 0, "model.lora.alpha must be > 0"),
                (0.0 <= self.dropout < 1.0, "model.lora.dropout must be in [0, 1)"),
                (bool(self.target_modules), "model.lora.target_modules must not be empty"),
            ]
        )


@dataclass(frozen=True)
class TinyModelSettings:
    """The tiny model turnrl builds when ``model.path`` is empty (``model.tiny``)."""

    arch: Literal["qwen2", "llama", "qwen3", "llama3", "mistral"] = "qwen2"
    """Tiny model architecture and chat family (used only when ``path`` is empty):
    ``qwen2``/``llama`` with turnrl's ChatML template, or a family's own template and
    control tokens (``qwen3``, ``llama3``, ``mistral``; ``turnrl.models.FAMILIES``)."""
    hidden_size: int = 128
    """Tiny model width."""
    num_layers: int = 4
    """Tiny model depth."""
    num_heads: int = 4
    """Tiny model attention heads."""
    vocab_size: int = 2048
    """Tiny model tokenizer vocabulary (BPE trained locally)."""
    echo_steps: int = 0
    """Tiny model: steps of generic "repeat what was said" tuning after initialisation
    (in-context copying, which real base models have); 0 keeps it random."""
    echo_novel: float = 0.0
    """Tiny model: share of the echo chats on made-up words, so it can copy names it has
    never seen (a world of fresh names, as in ``search_qa``); 0 copies known words only."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model to train."""

    path: str = ""
    """A local checkpoint directory or hub id; a ``.gguf`` file (or a directory holding
    one), imported once into a float32 checkpoint in turnrl's cache; a named model
    (``turnrl models list``: ``smollm2-135m``, from its installed package). Empty builds
    the tiny model into the run directory."""
    tiny: TinyModelSettings = field(default_factory=TinyModelSettings)
    """The tiny model's shape, family and echo tuning (used only when ``path`` is empty)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (``rank > 0``) instead of full fine-tuning."""
    device: str = "auto"
    """Where the learner and the torch sampler run: ``auto`` (the first CUDA device if
    there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    precision: Literal["float32", "bf16-mixed"] = "float32"
    """``float32`` throughout, or ``bf16-mixed``: master weights and optimizer state stay
    float32, forward and backward run under bfloat16 autocast (the learner and the torch
    sampler; log-probs and losses are computed in float32); a vLLM sampler runs bfloat16.
    Sampler and learner then agree only to bf16 rounding: see
    ``rollout.startup_tolerance``."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them:
    less memory for longer sequences, about a third more compute."""
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """The attention kernel (transformers' ``attn_implementation``); ``auto`` is
    transformers' default (``sdpa``). ``flash_attention_2`` needs CUDA and flash-attn."""

    def __post_init__(self) -> None:
        _require(
            [
                (
                    re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
                    f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
                ),
            ]
        )


@dataclass(frozen=True)
class EnvConfig:
    """Which environment, with its own options (see ``turnrl envs list``)."""

    name: str = "secret_lookup"
    """A registered environment name."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options of that environment (its dataclass fields), e.g. ``num_values``."""


@dataclass(frozen=True)
class RolloutConfig:
    """How episodes are sampled each step."""

    prompts_per_step: int = 16
    """Tasks per step (P)."""
    group_size: int = 8
    """Samples per task (G); advantages compare samples within a group."""
    temperature: float = 1.0
    """Sampling temperature (the learner scales logits by the same value)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_turns: int = 4
    """Model turns per episode."""
    max_tokens_per_turn: int = 48
    """Tokens per completion."""
    max_episode_tokens: int = 160
    """Sampled tokens per episode."""
    max_context_tokens: int = 512
    """Prompt plus everything after it."""
    backend: Literal["torch", "vllm"] = "torch"
    """The sampling engine: turnrl's own torch sampler (the reference; shares the learner's
    model), or vLLM in this process (``pip install 'turnrl[vllm]'``; weights synced in
    place after every update). On a CPU, vLLM needs attention heads of at least 32 wide
    (``model.tiny.hidden_size / model.tiny.num_heads`` for the tiny model)."""
    sampler_weights: Literal["auto", "shared", "bf16"] = "auto"
    """The torch sampler's weights. ``shared``: the learner's own model, no copy (under
    bf16-mixed it autocasts like the learner, which recasts the float32 weights at every
    decoding step). ``bf16``: a bfloat16 copy, refreshed after every update; it costs half
    the weights' memory again and recasts nothing, and a LoRA policy is merged into it, so
    the adapters cost sampling nothing. It differs from the learner by bf16 rounding, so
    ``startup_tolerance`` is bf16's and ``algorithm.off_policy`` ``auto`` is ``token_tis``.
    ``auto``: ``bf16`` under ``model.precision = bf16-mixed``, else ``shared``; ``bf16``
    with ``float32`` gives a float32 learner and a bf16 sampler (on the tiny probe the
    learner's bf16 stalled learning and the sampler's did not: docs/gpu.md).
    vLLM always holds its own copy (bfloat16 under bf16-mixed) and ignores this setting."""
    startup_tolerance: float = 0.0
    """Before step 1, the sampler's log-probs of a probe batch are compared with the
    learner's: a larger gap (in nats, per token) stops the run, since training would
    silently correct for engine drift. 0 picks it from ``model.precision``: 1e-3 for
    float32 (engines agree to about 1e-6), 0.1 for bf16-mixed or a bf16 sampler (bf16
    rounding: 2e-3 measured between the autocast torch sampler and the learner on the tiny
    model on a CPU; an engine holding bf16 weights differs more)."""
    max_error_frac: float = 0.0
    """Share of a step's episodes that may fail with an exception (raised by the
    environment, a tool factory, the verifier or the backend) before the run stops with the
    first failure's traceback. The model's mistakes (malformed calls, bad arguments, unknown
    tools, a tool's error) are observations and never count. A step whose every episode
    failed stops the run whatever this says: there is nothing to train on."""
    episode_timeout_s: float = 900.0
    """Wall-clock limit of one episode, in seconds (0: none). An episode past it is
    recorded as failed, naming what it waited for (the model, a tool, an agent), and
    counts against ``max_error_frac``; it never blocks its batch."""

    def __post_init__(self) -> None:
        _require(
            [
                (
                    self.group_size >= 2,
                    "rollout.group_size must be >= 2 (advantages compare a group)",
                ),
                (self.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1"),
                (self.max_turns >= 1, "rollout.max_turns must be >= 1"),
                (0.0 <= self.max_error_frac <= 1.0, "rollout.max_error_frac must be in [0, 1]"),
                (self.episode_timeout_s >= 0.0, "rollout.episode_timeout_s must be >= 0"),
                (self.startup_tolerance >= 0.0, "rollout.startup_tolerance must be >= 0"),
                (self.max_tokens_per_turn >= 1, "rollout.max_tokens_per_turn must be >= 1"),
                (0.0 < self.top_p <= 1.0, "rollout.top_p must be in (0, 1]"),
                (self.temperature > 0.0, "rollout.temperature must be > 0 for training"),
            ]
        )


@dataclass(frozen=True)
class ClipConfig:
    """PPO's clipped ratio (``algorithm.clip``)."""

    low: float = 0.2
    """Lower bound 1 - low (1: none, CISPO's choice). Under ``policy_loss = "gmpo"`` both
    bounds are on log r: [-low, high]."""
    high: float = 0.2
    """Upper bound 1 + high (DAPO's clip-higher uses 0.28)."""
    dual: float = 0.0
    """Dual clip c (> 1) bounding the loss of negative-advantage tokens (PPO loss only); 0
    disables."""

    def __post_init__(self) -> None:
        _require(
            [
                (0.0 <= self.low <= 1.0, "algorithm.clip.low must be in [0, 1]"),
                (self.high >= 0.0, "algorithm.clip.high must be >= 0"),
                (self.dual == 0.0 or self.dual > 1.0, "algorithm.clip.dual must be 0 (off) or > 1"),
            ]
        )


@dataclass(frozen=True)
class KLConfig:
    """A KL to the reference policy, the policy when RL starts (``algorithm.kl``)."""

    coef: float = 0.0
    """Weight of the KL estimate; 0 loads no reference model."""
    estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    """Estimator of KL(policy || reference) per token."""
    placement: Literal["loss", "reward"] = "loss"
    """Added to the loss (GRPO's way), or subtracted from the reward (PPO's and
    REINFORCE++'s way: per token for REINFORCE++ and GAE, summed over the sampled tokens
    for the group estimators); recorded as the ``kl_penalty`` component."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.coef >= 0.0, "algorithm.kl.coef must be >= 0"),
            ]
        )


@dataclass(frozen=True)
class FilterConfig:
    """Which sampled groups are trained on (``algorithm.filter``)."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: train only on groups whose rewards differ, sampling more
    prompts (up to ``max_rounds`` rounds per step) to fill the batch."""
    max_rounds: int = 1
    """Rounds of ``rollout.prompts_per_step`` groups a step may sample."""
    variance_keep: float = 1.0
    """StarPO-S: keep this top fraction of groups by reward std (1 keeps all)."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.max_rounds >= 1, "algorithm.filter.max_rounds must be >= 1"),
                (
                    0.0 < self.variance_keep <= 1.0,
                    "algorithm.filter.variance_keep must be in (0, 1]",
                ),
            ]
        )


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO's handling of episodes that hit ``rollout.max_episode_tokens``
    (``algorithm.overlong``)."""

    penalty_tokens: int = 0
    """Soft overlong punishment: the reward ramps down to -1 over the last this many tokens
    of ``rollout.max_episode_tokens`` (0: off)."""
    filter: bool = False
    """Overlong filtering: truncated episodes are not trained on."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.penalty_tokens >= 0, "algorithm.overlong.penalty_tokens must be >= 0"),
            ]
        )


@dataclass(frozen=True)
class OffPolicyConfig:
    """The sampler/learner mismatch pi_learner / pi_sampler (``algorithm.off_policy``)."""

    correction: Literal[
        "auto", "none", "token_tis", "sequence_tis", "sequence_mask",
        "token_mis", "sequence_mis", "icepop", "geometric_mask",
    ] = "auto"  # fmt: skip
    """Truncated importance weights per token or per sequence (capped at ``cap``), or
    dropping sequences whose ratio exceeds ``cap``; masked importance weights (the ratio
    inside the band ``min_ratio``..``max_ratio``, the token or sequence dropped outside it)
    per token (``token_mis``), per sequence (``sequence_mis``) or IcePop's two-sided token
    band (``icepop``); or dropping sequences whose geometric-mean ratio leaves the band
    (``geometric_mask``). ``auto`` is ``token_tis`` when another engine samples
    (``rollout.backend = "vllm"``) or older weights do (``algorithm.max_staleness`` > 0),
    and ``none`` when the learner's own model does (docs/algorithms.md)."""
    cap: float = 2.0
    """Cap C of the truncated importance weights / the sequence mask's threshold / the
    upper end of the MIS band."""
    min_ratio: float = 0.0
    """Lower end of the masks' band (0: the correction's own: none for token_mis and
    sequence_mis, 0.5 for icepop, 0.999 for geometric_mask)."""
    max_ratio: float = 0.0
    """Upper end of the masks' band (0: the correction's own: ``cap`` for token_mis and
    sequence_mis, 5 for icepop, 1.001 for geometric_mask)."""

    @property
    def band(self) -> tuple[float | None, float]:
        """The masks' (lower, upper) ratio band under this ``correction``: the ends set,
        else its own (``BANDS``; MIS: none and ``cap``); a lower end of None is none."""
        low, high = BANDS.get(self.correction, (None, None))
        return (self.min_ratio or low, self.max_ratio or high or self.cap)

    def __post_init__(self) -> None:
        low, high = self.band
        _require(
            [
                (self.cap > 0.0, "algorithm.off_policy.cap must be > 0"),
                (self.min_ratio >= 0.0, "algorithm.off_policy.min_ratio must be >= 0"),
                (self.max_ratio >= 0.0, "algorithm.off_policy.max_ratio must be >= 0"),
                (
                    low is None or low <= high,
                    "algorithm.off_policy.min_ratio must be <= max_ratio",
                ),
            ]
        )


BANDS: dict[str, tuple[float | None, float | None]] = {
    "token_mis": (None, None),
    "sequence_mis": (None, None),
    "icepop": (0.5, 5.0),
    "geometric_mask": (0.999, 1.001),
}
"""The default (lower, upper) ratio band of each masking correction (docs/algorithms.md):
MIS one-sided at ``cap`` (None), IcePop's [0.5, 5], Geo-RS's +-0.1% per token."""


@dataclass(frozen=True)
class SAPOConfig:
    """SAPO's soft gate, ``policy_loss = "sapo"`` (``algorithm.sapo``)."""

    tau_pos: float = 1.0
    """Gate temperature for tokens with a positive advantage."""
    tau_neg: float = 1.05
    """Gate temperature for the others (larger: they fade faster off-policy)."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.tau_pos > 0.0, "algorithm.sapo.tau_pos must be > 0"),
                (self.tau_neg > 0.0, "algorithm.sapo.tau_neg must be > 0"),
            ]
        )


@dataclass(frozen=True)
class CriticConfig:
    """The learned value function of ``advantage = "gae"`` (``algorithm.critic``)."""

    placement: Literal["head", "model"] = "model"
    """A value head on the policy's (detached) hidden states, or a separate value model (a
    copy of the starting policy plus a head)."""
    lr: float = 1e-3
    """The critic's AdamW learning rate."""
    epochs: int = 1
    """Critic optimizer steps per rollout batch."""
    value_clip: float = 0.2
    """PPO value clipping range around the rollout's values (0: unclipped)."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.lr > 0.0, "algorithm.critic.lr must be > 0"),
                (self.epochs >= 1, "algorithm.critic.epochs must be >= 1"),
                (self.value_clip >= 0.0, "algorithm.critic.value_clip must be >= 0"),
            ]
        )


@dataclass(frozen=True)
class GAEConfig:
    """Generalised advantage estimation, ``advantage = "gae"`` (``algorithm.gae``)."""

    gamma: float = 1.0
    """Discount over sampled tokens (1 as in RAGEN and Search-R1)."""
    lam: float = 1.0
    """Lambda (1: the return minus the value; PPO's classic choice is 0.95)."""
    level: Literal["token", "turn"] = "token"
    """GAE over sampled tokens, or turn-level (bi-level, RAGEN) GAE: first over turns with
    ``turn_gamma``, then over the tokens inside each turn (docs/algorithms.md)."""
    turn_gamma: float = 0.95
    """Turn-level GAE: the discount between turns."""
    whiten: bool = True
    """Whiten the advantages over the batch's sampled tokens (PPO's usual practice)."""

    def __post_init__(self) -> None:
        _require(
            [
                (0.0 <= self.gamma <= 1.0, "algorithm.gae.gamma must be in [0, 1]"),
                (0.0 <= self.lam <= 1.0, "algorithm.gae.lam must be in [0, 1]"),
                (0.0 <= self.turn_gamma <= 1.0, "algorithm.gae.turn_gamma must be in [0, 1]"),
            ]
        )


@dataclass(frozen=True)
class GiGPOConfig:
    """GiGPO's step-level term, ``advantage = "gigpo"`` (``algorithm.gigpo``)."""

    gamma: float = 0.95
    """Discount of the step-level returns."""
    omega: float = 1.0
    """Weight of the step-level term."""

    def __post_init__(self) -> None:
        _require(
            [
                (0.0 <= self.gamma <= 1.0, "algorithm.gigpo.gamma must be in [0, 1]"),
                (self.omega >= 0.0, "algorithm.gigpo.omega must be >= 0"),
            ]
        )


@dataclass(frozen=True)
class TeacherConfig:
    """On-policy distillation: a frozen teacher scores the student's sampled tokens
    (``algorithm.teacher``; docs/algorithms.md, "On-policy distillation")."""

    path: str = ""
    """The teacher: a model directory or hub id, a ``.gguf`` file, a named model, a run's
    checkpoint directory (``runs/NAME/checkpoints/step_N``, LoRA adapters merged) or a run
    directory (its latest checkpoint, read when the run starts or resumes); empty: no
    teacher. It is loaded once, frozen, in float32 on the learner's device, and must have
    the student's tokenizer vocabulary exactly (it scores the student's token ids). A
    server (``http://...``) is refused: its log-probs of given tokens are not read yet."""
    coef: float = 1.0
    """Weight of the per-token reverse KL(student || teacher): every sampled token's
    advantage gains ``-coef * (log pi_student - log pi_teacher)`` (detached), trained
    through the policy loss like the RL advantage."""
    alone: bool = False
    """Pure distillation: the advantage is the teacher's term only, and the rewards are
    computed and logged but not trained on; false adds the term to the RL advantage (with
    ``advantage = "gae"``, to the token rewards the critic's GAE credits)."""

    def __post_init__(self) -> None:
        server = re.match(r"(?i)(https?|grpc)://", self.path) is not None
        _require(
            [
                (
                    not server,
                    f"algorithm.teacher.path = {self.path!r}: a teacher behind a server "
                    "(vLLM, an OpenAI-compatible endpoint) is not supported; distillation "
                    "needs the teacher's log-prob of every token the student sampled, which "
                    "turnrl computes with the teacher loaded in this process: give a model "
                    "directory, a checkpoint directory or a run directory",
                ),
                (self.coef >= 0.0, "algorithm.teacher.coef must be >= 0"),
                (
                    not self.path or self.coef > 0.0,
                    "algorithm.teacher.coef must be > 0 with a teacher (0 would load the "
                    "teacher for nothing; leave algorithm.teacher.path empty instead)",
                ),
                (
                    bool(self.path) or not self.alone,
                    "algorithm.teacher.alone (pure distillation) needs a teacher: set "
                    "algorithm.teacher.path",
                ),
            ]
        )


@dataclass(frozen=True)
class MicroBatchConfig:
    """How the learner splits a batch into forward/backward passes; it never changes the
    update, only memory and speed (``algorithm.micro_batch``)."""

    size: int = 64
    """Sequences per forward/backward at most; gradients accumulate to the whole batch."""
    tokens: int = 0
    """Tokens per forward/backward at most, padding included (packed: real tokens); a
    micro-batch holds at least one sequence. 0 picks a budget from the free accelerator
    memory on CUDA and sets none on CPU (``size`` alone)."""
    layout: Literal["auto", "padded", "packed"] = "auto"
    """``padded`` rows (the common prefix of the rows run once), ``packed`` back to back
    (no padding, no prefix reuse), or ``auto``: whichever computes fewer token positions
    (agent groups sharing a long prompt pad; sequences of very different lengths pack)."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.size >= 1, "algorithm.micro_batch.size must be >= 1"),
                (self.tokens >= 0, "algorithm.micro_batch.tokens must be >= 0"),
            ]
        )


@dataclass(frozen=True)
class AlgorithmConfig:
    """The policy update: advantages, a clipped policy loss, a reduction, an optional KL.

    Each choice is made by name here, once (docs/algorithms.md defines them all); the knobs of
    one estimator or mechanism live in its own section (``algorithm.kl.coef``).
    """

    advantage: Literal[
        "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gigpo", "gae"
    ] = "grpo"
    """Advantage estimator: GRPO (mean and unbiased std of the group), Dr. GRPO (mean
    only), RLOO (leave-one-out mean), REINFORCE++ (returns whitened over the batch's
    tokens; ``_baseline`` subtracts the group mean first), or GiGPO (GRPO per episode plus
    a step-level term among turns of one task that saw an identical context), or GAE with
    a learned critic (PPO; see ``critic`` and ``gae``)."""
    policy_loss: Literal["ppo", "gspo", "cispo", "gmpo", "sapo"] = "ppo"
    """PPO's clipped surrogate per token, or GSPO's on one length-normalised ratio per
    sequence (use GSPO's small clip ranges, e.g. clip.low 3e-4, clip.high 4e-4), CISPO's
    REINFORCE weighted by the clipped, detached ratio, GMPO's clipped geometric mean of the
    token ratios (clip on log r), or SAPO's soft gate (``sapo``) (docs/algorithms.md)."""
    loss_reduction: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
    ] = "token_mean"
    """How per-token losses become one number; normalisers are those of the whole batch, so
    micro-batching does not change the update. ``seq_mean_token_sum_norm`` divides by
    ``rollout.max_episode_tokens`` (Dr. GRPO's constant)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (global L2 norm)."""
    epochs: int = 1
    """Optimizer steps per rollout batch (PPO epochs); the first is on-policy."""
    entropy_coef: float = 0.0
    """Entropy bonus: this times the (reduced) policy entropy is subtracted from the loss."""
    max_staleness: int = 0
    """Asynchronous training: a batch may be sampled by a policy up to this many versions
    older than the learner's. 0 is the synchronous loop, exactly; k >= 1 collects the next
    k steps' batches in the background while this step updates (the sampler then holds its
    own copy of the weights, synced between batches, so no turn mixes versions; each batch
    takes the newest weights there are when it starts: trainer/pipeline.py). k = 1 is
    reproducible; with k >= 2 which version samples a batch depends on timing, and the
    learner's weights are copied once more. Behaviour log-probs feed ``off_policy``
    (``auto`` turns ``token_tis`` on); ``rollout/staleness_<d>`` is the histogram."""
    partial_rollouts: bool = False
    """With ``max_staleness`` >= 1: the engine takes the learner's new weights as soon as
    an update ends, mid-batch, between turns (it lets the turns being sampled finish
    first, so no turn mixes versions). The episodes in flight sample their next turns with
    the newer weights, and every turn records its version: a batch is less stale, at the
    cost of one more copy of the policy (the weights the engine takes them from) and of
    runs that are not reproducible bit for bit (when a sync lands depends on timing).
    Off: an episode finishes on the weights its batch started with. Rollout workers are
    offered the weights after each update and take them the same way."""
    overlap_batches: bool = False
    """With ``partial_rollouts`` and ``max_staleness`` >= 2: the batches collected ahead
    run on the engine at the same time, each starting as soon as the bound lets it, instead
    of one after the other; a batch's slowest episodes then no longer hold up the next
    batch's start (the engine fills its free slots with the next batch's episodes). The
    engine is never idle between batches, so it takes new weights between turns only
    (hence ``partial_rollouts``). Rollout workers each run the batches' shards they hold
    together on their engine in the same way."""
    control: Literal["none", "shuffled_rewards"] = "none"
    """A negative control: ``shuffled_rewards`` permutes rewards across the batch."""
    clip: ClipConfig = field(default_factory=ClipConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    gae: GAEConfig = field(default_factory=GAEConfig)
    gigpo: GiGPOConfig = field(default_factory=GiGPOConfig)
    sapo: SAPOConfig = field(default_factory=SAPOConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    micro_batch: MicroBatchConfig = field(default_factory=MicroBatchConfig)

    @property
    def overlapping(self) -> bool:
        """Whether batches overlap: ``overlap_batches`` where there is more than one batch
        ahead to overlap (``max_staleness`` >= 2)."""
        return self.overlap_batches and self.max_staleness >= 2

    def __post_init__(self) -> None:
        _require(
            [
                (self.lr > 0.0, "algorithm.lr must be > 0"),
                (self.epochs >= 1, "algorithm.epochs must be >= 1"),
                (self.entropy_coef >= 0.0, "algorithm.entropy_coef must be >= 0"),
                (0 <= self.max_staleness <= 8, "algorithm.max_staleness must be in 0..8"),
                (
                    self.partial_rollouts or not self.overlap_batches,
                    "algorithm.overlap_batches needs algorithm.partial_rollouts = true: with "
                    "batches overlapping the engine is never idle, so it takes new weights "
                    "between turns",
                ),
                (
                    self.policy_loss == "ppo" or not self.clip.dual,
                    "algorithm.clip.dual applies to the ppo policy loss only",
                ),
                (
                    not (self.teacher.alone and self.kl.coef > 0 and self.kl.placement == "reward"),
                    "algorithm.teacher.alone trains on the teacher's term only, so a KL in the "
                    "reward would be dropped: set algorithm.kl.placement = 'loss' or "
                    "algorithm.kl.coef = 0",
                ),
            ]
        )


@dataclass(frozen=True)
class WarmupConfig:
    """The syntax-only supervised warm-up (format demonstrations, random content)."""

    steps: int = 60
    """Optimizer steps; 0 skips the warm-up."""
    batch_size: int = 32
    """Demonstrations per step."""
    lr: float = 3e-3
    """AdamW learning rate."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.steps >= 0, "warmup.steps must be >= 0"),
            ]
        )


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation during training."""

    every: int = 10
    """Evaluate every this many steps (and before the first and after the last)."""
    num_tasks: int = 128
    """Held-out tasks, one sample each, at the training temperature."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.every >= 1, "eval.every must be >= 1"),
            ]
        )


@dataclass(frozen=True)
class LogConfig:
    """Where metrics go besides metrics.jsonl (which is always written)."""

    tensorboard: bool = True
    """TensorBoard event files in ``run_dir/tensorboard`` (``tensorboard --logdir``)."""
    wandb: bool = False
    """Also log to Weights & Biases (``pip install 'turnrl[wandb]'``)."""
    wandb_project: str = "turnrl"
    """W&B project name."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline`` needs no account or network (``wandb sync`` uploads later)."""


@dataclass(frozen=True)
class MonitorConfig:
    """Collapse alarms computed every step from the metrics (trainer/monitors.py).

    Each alarm compares the median of a metric's last ``window`` values with a reference
    level; the fields below are the thresholds of those comparisons.
    """

    action: Literal["none", "stop", "filter"] = "none"
    """What an alarm does besides being printed and logged: ``stop`` saves a checkpoint and
    ends the run after the step that raised it; ``filter`` switches on StarPO-S variance
    filtering (``filter_keep``) for the rest of the run, if it is not on already."""
    filter_keep: float = 0.5
    """With ``action = "filter"``: the top fraction of groups by reward std kept."""
    warmup_steps: int = 20
    """No alarm before a metric has this many values (early steps are unrepresentative)."""
    window: int = 10
    """Recent values whose median is compared with the reference. The defaults raise no
    alarm on simulated healthy runs of 16 prompts x 8 samples; fewer prompts per step make
    the rollout metrics noisier: widen this (or the thresholds) then."""
    baseline_window: int = 20
    """Values before the recent window whose median is the trailing baseline."""
    cooldown_steps: int = 10
    """After an alarm, the metric must be back at least halfway to its reference this many
    consecutive steps before the alarm can fire again (a lasting problem is one alarm)."""
    reward_std_frac: float = 0.5
    """In-group reward std falling below this fraction of its best level (and by 0.02)."""
    zero_variance_rise: float = 0.3
    """Zero-variance group fraction rising this much (absolute) above its lowest level."""
    entropy_frac: float = 0.3
    """Entropy falling below this fraction of its best level (and by 0.05 nats): a collapse."""
    entropy_jump: float = 2.0
    """Entropy rising above this multiple of its trailing baseline (plus 0.05 nats): a jump.
    Below 1 it fires as soon as the warm-up ends (a way to try ``action``)."""
    grad_norm_spike: float = 10.0
    """One step's gradient norm at this multiple of its trailing baseline. RL gradient
    norms are heavy-tailed: in a healthy quick-start run 1% of steps exceed 5x."""
    tool_calls_frac: float = 0.5
    """Tool calls per episode falling below this fraction of their best level (and by 0.1)."""
    solved_success: float = 0.8
    """Success rate (median of the last ``window`` steps) at which falling entropy, falling
    in-group reward std and rising zero-variance groups count as convergence, not collapse:
    those three alarms stay quiet. Above 1 turns that off."""
    mismatch_rise: float = 2.0
    """Sampler/learner log-prob mismatch rising above this multiple of its lowest level
    (plus 0.01 nats per token)."""
    slowdown_frac: float = 0.25
    """Sampled tokens per second of a step falling below this fraction of its best level:
    another job is sharing the cores, or memory is swapping. 0 turns it off."""

    def __post_init__(self) -> None:
        # Checked here rather than in Config: monitors also run on their own (replaying a
        # finished run's metrics.jsonl).
        checks = [
            (self.window >= 1, "monitor.window must be >= 1"),
            (self.baseline_window >= 1, "monitor.baseline_window must be >= 1"),
            (
                self.warmup_steps > self.window,
                "monitor.warmup_steps must be > monitor.window (the baseline needs values)",
            ),
            (self.cooldown_steps >= 0, "monitor.cooldown_steps must be >= 0"),
            (0.0 < self.filter_keep < 1.0, "monitor.filter_keep must be in (0, 1)"),
            (0.0 < self.reward_std_frac < 1.0, "monitor.reward_std_frac must be in (0, 1)"),
            (0.0 < self.zero_variance_rise <= 1, "monitor.zero_variance_rise must be in (0, 1]"),
            (0.0 < self.entropy_frac < 1.0, "monitor.entropy_frac must be in (0, 1)"),
            (self.entropy_jump > 0.0, "monitor.entropy_jump must be > 0"),
            (self.grad_norm_spike > 1.0, "monitor.grad_norm_spike must be > 1"),
            (0.0 < self.tool_calls_frac < 1.0, "monitor.tool_calls_frac must be in (0, 1)"),
            (self.mismatch_rise > 1.0, "monitor.mismatch_rise must be > 1"),
            (0.0 <= self.slowdown_frac < 1.0, "monitor.slowdown_frac must be in [0, 1)"),
            (self.solved_success > 0.0, "monitor.solved_success must be > 0"),
        ]
        _require(checks)


@dataclass(frozen=True)
class ClusterConfig:
    """Beyond one process: the learner's ranks and the rollout workers (``cluster``;
    docs/scaling.md).

    0 learner ranks and 0 rollout workers is the single-process run, the reference every
    other layout must match."""

    learner_ranks: int = 0
    """Learner processes: 0 trains in this process (the reference); N >= 1 runs a
    ``LearnerGroup`` of N ranks under FSDP2 (gloo on a CPU, NCCL with one GPU per rank),
    whose update equals the in-process one within 1e-5. The engine samples in this
    process, loaded with the group's full weights after every update."""
    fsdp_unit: Literal["layer", "model"] = "layer"
    """How the learner ranks shard the model under FSDP2: each decoder layer a unit of its
    own, gathered only while it computes, and so are untied input and output embeddings
    (``layer``: a rank holds one layer whole at a time, so a model larger than a device
    trains), or the whole model one unit (``model``:
    fewer, larger collectives; every parameter whole on each rank while it computes)."""
    learner_placement: Literal["local", "ray"] = "local"
    """Where the learner ranks run: processes of the driver on this machine (``local``), or
    Ray actors on the cluster at ``address`` (``ray``: wherever Ray places them, several
    nodes included; a GPU each on GPUs), joined through a store on the driver's node."""
    rollout_workers: int = 0
    """Inference engines with their environments: 0 samples in this process; N >= 1 runs
    the episodes on N Ray actors (a local Ray cluster, or ``address``'s), each a torch
    engine with its own environments, synced from the learner after every update. One
    worker gives the in-process run's metrics exactly."""
    weight_sync: Literal["auto", "object_store", "broadcast"] = "auto"
    """How the learner's weights reach the rollout workers after every update:
    ``object_store``: put once into Ray's object store (shared memory on a node), and each
    worker reads them from there; ``broadcast``: one collective broadcast from the driver to
    every worker over a group of their own (weight_broadcast.py): gloo on CPUs, NCCL on
    GPUs, where the weights stay in GPU memory (every worker then needs a GPU other than
    the driver's; not yet run on GPUs); ``auto``: the broadcast for a policy on the CPU
    (where it was faster from 3M parameters up: benchmarks/results/scale.md, "Weight
    sync"), the object store for one on a GPU."""
    worker_timeout_s: float = 900.0
    """The deadline of each call to a rollout worker (a batch of episodes, a weight sync);
    a worker that misses it stops the run with an error naming it."""
    address: str = ""
    """The Ray cluster the rollout workers (and ranks placed by Ray) join: ``HEAD_IP:6379``
    as ``ray start --head`` prints it, or ``"auto"`` for the one this machine is a node of;
    "" starts a local one on this machine. Checked before the run builds anything: nothing
    accepting a connection there within 10 s is an error, and so is no Ray head answering
    within 3 of Ray's tries (about 2 minutes). Not a Ray Client's ``ray://`` address: the
    driver runs here, and the workers and ranks connect to it directly (the weight
    broadcast's store, the learner's rendezvous), so it must be where the cluster reaches
    it."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.learner_ranks >= 0, "cluster.learner_ranks must be >= 0"),
                (self.rollout_workers >= 0, "cluster.rollout_workers must be >= 0"),
                (self.worker_timeout_s > 0, "cluster.worker_timeout_s must be > 0"),
                (
                    self.learner_placement == "local" or self.learner_ranks >= 1,
                    "cluster.learner_placement = 'ray' places learner ranks: set "
                    "cluster.learner_ranks >= 1",
                ),
                (
                    not self.address.startswith("ray://"),
                    f"cluster.address = {self.address!r}: Ray Client addresses are not "
                    "supported (the workers and ranks connect to the driver directly): run "
                    "turnrl on a machine the cluster reaches, with the head's address as "
                    "`ray start --head` prints it (HEAD_IP:6379)",
                ),
            ]
        )


@dataclass(frozen=True)
class Config:
    """A whole run."""

    name: str = "quickstart"
    """Run name (the default run directory is runs/<name>)."""
    seed: int = 0
    """Run seed; every sample's seed derives from it."""
    steps: int = 60
    """RL steps."""
    max_minutes: float = 0.0
    """Stop after the step that crosses this wall-clock budget (0: no budget)."""
    threads: int = 0
    """torch CPU threads; 0 keeps torch's default."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end)."""
    log_groups: int = 2
    """Groups per step written to trajectories.jsonl."""
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        # Each section checks its own fields when it is made; here only what spans sections.
        penalty, longest = self.algorithm.overlong.penalty_tokens, self.rollout.max_episode_tokens
        _require(
            [
                (self.steps >= 0, "steps must be >= 0"),
                (self.save_every >= 1, "save_every must be >= 1"),
                (self.max_minutes >= 0.0, "max_minutes must be >= 0"),
                (
                    not (self.algorithm.teacher.path and self.cluster.learner_ranks),
                    "algorithm.teacher.path with cluster.learner_ranks >= 1 is not supported "
                    "yet: the teacher scores with the in-process learner; set "
                    "cluster.learner_ranks = 0",
                ),
                (
                    penalty <= longest,
                    f"algorithm.overlong.penalty_tokens ({penalty}) must be <= "
                    f"rollout.max_episode_tokens ({longest})",
                ),
            ]
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_(self, settings: Mapping[str, Any] | None = None, /, **more: Any) -> Config:
        """A copy with ``settings`` changed: dotted keys to typed values,
        ``config.with_({"rollout.max_turns": 4, "algorithm.kl.coef": 0.0})``; top-level
        keys also as keywords, ``config.with_(steps=100)``. Checked exactly as ``--set``
        checks them: an unknown key or a value of the wrong type is a ``ConfigError``
        naming it (a string is not read as a number here: ``"4"`` is refused where an int
        is expected). ``env.name`` to another environment drops the options of the old
        one."""
        from turnrl.trainer.config.loading import apply_settings

        return apply_settings(self.to_dict(), [*(settings or {}).items(), *more.items()])


def field_help(cls: type[Any]) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), first sentence.

    Read from ``help.HELP``, a table generated from these docstrings (dev/config_help.py):
    Python keeps no attribute docstring at run time, and a build may ship no source."""
    return dict(HELP.get(cls.__name__, {}))


def describe(config: Config) -> list[str]:
    """The resolved configuration as TOML, each setting with its one-line help."""
    lines: list[str] = []

    def section(obj: Any, title: str | None) -> None:
        helps = field_help(type(obj))
        if title:
            doc = (type(obj).__doc__ or "").strip().splitlines()[0]
            lines.extend(["", f"[{title}]  # {doc}"])
        nested = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((value, f.name))
                continue
            if title == "env" and f.name == "options":
                for key, option in sorted(value.items()):
                    lines.append(f"{key} = {json.dumps(option)}  # an option of the environment")
                continue
            shown = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
            lines.append(f"{f.name} = {shown}  # {helps.get(f.name, '')}".rstrip(" #"))
        for value, name in nested:
            section(value, f"{title}.{name}" if title else name)

    section(config, None)
    return lines
