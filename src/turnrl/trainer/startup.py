"""A run's start-up, before its first step: everything ``loop.train`` needs built and checked.

``start`` reads top to bottom: what would stop the engine, said first (``_check_engine``);
the model (built, imported, or loaded from the checkpoint), warmed up on format
demonstrations on a fresh run (``_warmup``) and saved as the start policy; LoRA adapters;
the learner (``make_learner``'s, or in this process) and the sampling engine; on a resume,
the optimizer, policy version and critic; the chat template probed in the environment's
call format (``check_template``); the rollout workers, if any; and the sampler's log-probs
against the learner's (``check_sampler``). What it returns (``StartedRun``) is all the loop
(loop.py) uses.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from turnrl.backends.torch_backend import TorchBackend
from turnrl.envs import EnvFamily
from turnrl.errors import BackendError, ConfigError, TemplateError
from turnrl.models import (
    TinyModelConfig,
    build_tiny_model,
    load_model,
    load_tokenizer,
    resolve_model,
)
from turnrl.models.loading import stop_token_ids
from turnrl.models.lora import ADAPTER_CONFIG, add_lora, is_lora, load_adapters, merged_state_dict
from turnrl.protocols import Backend, Env, close_env, env_format, env_tools
from turnrl.rollout.batch import trainable
from turnrl.rollout.chat import ChatRenderer, template_report
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, derive_seed
from turnrl.rollout.failures import check_failures
from turnrl.rollout.groups import GroupSpec
from turnrl.trainer.checkpoint import load_extra, load_trainer_state, save_start_policy
from turnrl.trainer.config import Config, resolved
from turnrl.trainer.learner import Learner
from turnrl.trainer.step import RunParts, run_groups
from turnrl.trainer.teacher import load_teacher, teacher_model_path
from turnrl.trainer.warmup import demonstration_trajectories, supervised_warmup, warmup_samples
from turnrl.trainer.workers import RolloutWorkers

if TYPE_CHECKING:
    from turnrl.backends.vllm_backend import VLLMBackend

Row = dict[str, Any]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnerSpec:
    """What the run's learner is made from: ``train``'s ``make_learner`` is called with it
    once, after the warm-up (or the resumed checkpoint's weights are loaded)."""

    model: Any
    """The policy in this process. The engine samples with it (the torch backend shares
    the object; vLLM is synced from it after every update) and checkpoints save it: a
    learner that trains elsewhere loads its new weights into it after each update."""
    config: Config
    """The run's configuration, resolved."""
    start_model: Path
    """The policy RL started from (``run_dir/start_model``): the KL reference."""
    resumed: bool
    """Whether the run resumes from a checkpoint (``model`` holds its weights; the
    optimizer's state is loaded into ``learner.optimizer`` right after)."""
    autocast: torch.dtype | None
    """The dtype the compute is autocast to (bf16-mixed), or None."""
    teacher: Any = None
    """On-policy distillation's teacher (``algorithm.teacher.path``), loaded and frozen,
    or None: the learner scores the samples with it (``teacher_logprobs``)."""


MakeLearner = Callable[[LearnerSpec], Any]
"""Makes the run's learner: a ``Learner``, or an object with the part of its interface the
step, the loop and the checkpoints use: ``model`` (the spec's), ``optimizer``
(``state_dict`` and ``load_state_dict`` in torch.optim's layout), ``critic`` (or None),
``step_samples`` (which leaves the new weights in ``model``), ``sampler_gap``,
``reference_kl``, ``teacher_logprobs`` (with a teacher) and ``refresh_model`` (brings the newest weights into ``model`` where it
may lag them, before a checkpoint reads it). ``turnrl.distributed`` gives one backed by a
``LearnerGroup``."""


@dataclass(frozen=True)
class WorkersSpec:
    """What the run's rollout workers are made from: ``train``'s ``make_workers`` is called
    with it once, when the policy's weights and version are those the first step samples
    with (after the warm-up, or the resumed checkpoint's)."""

    config: Config
    """The run's configuration, resolved."""
    env: EnvFamily
    """The environment family the workers run episodes of."""
    model: Any
    """The policy in this process, whose weights the workers start with."""
    tokenizer: Any
    version: int
    """Its policy version."""
    model_path: Path
    """The model directory the policy was loaded from (with LoRA, the base its adapters sit
    on): a vLLM worker builds its engine from it."""


MakeWorkers = Callable[[WorkersSpec], RolloutWorkers]
"""Makes the run's rollout workers (``workers.RolloutWorkers``); ``turnrl.distributed`` gives
Ray actors for ``cluster.rollout_workers >= 1``."""


def in_process_learner(spec: LearnerSpec) -> Learner:
    """The reference learner: in this process, training ``spec.model`` itself. A KL
    reference is the start policy: on a fresh run the model as it is now (the learner
    copies it), on a resume ``start_model`` loaded again (with LoRA, the base)."""
    c = spec.config
    reference = None
    if spec.resumed and c.algorithm.kl.coef > 0 and not is_lora(spec.model):
        device = next(spec.model.parameters()).device
        reference = load_model(
            spec.start_model, dtype=torch.float32, device=device, attention=c.model.attention
        )
    return Learner(
        spec.model, c.algorithm, temperature=c.rollout.temperature, reference=reference,
        teacher=spec.teacher, max_length=c.rollout.max_episode_tokens, autocast=spec.autocast,
    )  # fmt: skip


@dataclass
class StartedRun:
    """What start-up built, for the loop."""

    parts: RunParts
    tokenizer: Any
    row: Row
    """The step-0 row so far: the warm-up's numbers and the start-up checks'."""
    step: int
    """The step to continue from: 0 on a fresh run, the checkpoint's on a resume."""


def start(
    config: Config,
    spec: EnvFamily,
    run_dir: Path,
    checkpoint: Path | None,
    progress: bool,
    make_learner: MakeLearner | None = None,
    make_workers: MakeWorkers | None = None,
) -> StartedRun:
    """Build the run's parts (``_build``); on a resume, restore the checkpoint's state
    (``load_state``); check the chat template, then start the rollout workers (if
    ``make_workers``) with the weights step 1 samples with, then check the sampler on the
    engines that sample (the workers', if any)."""
    parts, tokenizer, first, model_path = _build(
        config, spec, run_dir, checkpoint, progress, make_learner,
        samples_here=make_workers is None,
    )  # fmt: skip
    step = load_state(parts, checkpoint) if checkpoint is not None else 0
    first.update(check_template(parts, progress))  # before any worker starts: it needs none
    if make_workers is not None:  # they start with the weights step 1 samples with
        made = WorkersSpec(
            config, spec, parts.learner.model, tokenizer, parts.backend.policy_version, model_path
        )
        parts = dataclasses.replace(parts, workers=make_workers(made))
    first.update(check_sampler(parts))  # on the engines that sample: the workers', if any
    return StartedRun(parts, tokenizer, first, step)


def _build(
    config: Config,
    spec: EnvFamily,
    run_dir: Path,
    checkpoint: Path | None,
    progress: bool,
    make_learner: MakeLearner | None = None,
    *,
    samples_here: bool = True,
) -> tuple[RunParts, Any, Row, Path]:
    """The model (built, or loaded from ``checkpoint``), warmed up on a fresh run; the
    learner (``make_learner``'s, or in this process) with its reference policy; the engine.
    Returns the run's parts, the tokenizer, the step-0 row so far (the warm-up's numbers) and
    the model directory the engines are built from.

    ``samples_here=False`` (the run has rollout workers, which hold the engines): the
    trainer's engine is a torch one on the policy itself that never samples; it keeps the
    policy version. No ``rollout.backend`` engine is built in this process: a vLLM one
    would take its memory (a GPU's, on a GPU) for nothing."""
    lora = config.model.lora.rank > 0
    _check_engine(config)
    if checkpoint is None:
        model_path = _base_model(config, spec, run_dir, progress)
    else:  # a LoRA checkpoint holds only the adapters: the base is the run's start_model
        _check_kind(checkpoint, lora)
        model_path = run_dir / "start_model" if lora else checkpoint / "model"
    tokenizer = load_tokenizer(model_path)
    m = config.model
    device = _device(m.device)
    # float32 master weights whatever the precision: bf16-mixed only autocasts the compute
    model = load_model(model_path, dtype=torch.float32, device=device, attention=m.attention)
    teacher = _teacher(config, tokenizer, model_path, device, progress)  # before the warm-up
    sampling, limits = episode_settings(config, tokenizer)
    renderer = ChatRenderer(tokenizer)
    first: Row = {"step": 0}
    if checkpoint is None and config.warmup.steps > 0:
        first.update(_warmup(config, spec, model, tokenizer, renderer, limits, sampling, progress))
    if checkpoint is None:
        save_start_policy(run_dir, model, tokenizer)
        if lora:  # the sampler loads the base the adapters sit on
            model_path = run_dir / "start_model"
    if lora:
        model = _with_lora(config, model, run_dir, checkpoint)
    elif (
        checkpoint is not None
        and config.algorithm.kl.coef > 0
        and not (run_dir / "start_model" / "config.json").is_file()
    ):
        raise ConfigError(
            f"cannot resume {run_dir} with a KL term: its start_model (the reference "
            "policy) is missing"
        )
    if m.gradient_checkpointing:
        checkpoint_activations(model)
    resumed = checkpoint is not None
    made = LearnerSpec(
        model, config, run_dir / "start_model", resumed, autocast_dtype(config), teacher
    )
    learner = (make_learner or in_process_learner)(made)
    backend = (
        _backend(config, model, tokenizer, model_path)
        if samples_here
        else TorchBackend(model, tokenizer)
    )
    return (
        RunParts.build(config, spec, backend, learner, renderer, limits, sampling),
        tokenizer,
        first,
        model_path,
    )


def _teacher(
    config: Config, tokenizer: Any, model_path: Path, device: torch.device, progress: bool
) -> Any:
    """On-policy distillation's teacher (``algorithm.teacher.path``), loaded and checked
    (teacher.py: ``load_teacher``) before the warm-up, so that a wrong one is said at once;
    None without one."""
    path = config.algorithm.teacher.path
    if not path:
        return None
    teacher = load_teacher(
        path, tokenizer, str(model_path), device=device, attention=config.model.attention
    )
    message = f"teacher: {teacher_model_path(path)} ({teacher.num_parameters():,} parameters)"
    if progress:
        say(message, progress)
    else:
        logger.info(message)
    return teacher


def episode_settings(config: Config, tokenizer: Any) -> tuple[SamplingParams, EpisodeLimits]:
    """How episodes are sampled and where they stop (``[rollout]``), for any engine."""
    r = config.rollout
    sampling = SamplingParams(r.temperature, r.top_p, stop_token_ids(tokenizer))
    limits = EpisodeLimits(
        r.max_turns, r.max_tokens_per_turn, r.max_episode_tokens, r.max_context_tokens,
        timeout_s=r.episode_timeout_s or None,
    )  # fmt: skip
    return sampling, limits


def _device(name: str) -> torch.device:
    """``model.device`` as a torch device (``auto``: CUDA where there is one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"model.device = {name!r} but torch sees no CUDA device (torch "
            f"{torch.__version__}); use model.device = 'cpu' or a CUDA build of torch"
        )
    return torch.device(name)


def checkpoint_activations(model: Any) -> None:
    """Gradient (activation) checkpointing, non-reentrant, by whichever name this
    transformers has (``activation_checkpointing_enable`` from 5.24)."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def autocast_dtype(config: Config) -> torch.dtype | None:
    """The dtype the learner's compute is autocast to, if any."""
    return torch.bfloat16 if config.model.precision == "bf16-mixed" else None


def sampler_copy_dtype(config: Config) -> torch.dtype | None:
    """The dtype of the torch sampler's own copy of the weights (``rollout.sampler_weights
    = bf16``), or None where it samples with the learner's model, autocast like it."""
    return torch.bfloat16 if resolved(config).rollout.sampler_weights == "bf16" else None


def torch_sampler(config: Config, model: Any, tokenizer: Any, model_path: Path) -> TorchBackend:
    """The torch engine for ``model`` (the learner's): sharing that very model, or holding
    a copy of it: a bf16 one (``rollout.sampler_weights``; a LoRA policy merged, loaded
    from ``model_path``, the base the adapters sit on) or, in asynchronous training, one
    that samples while the learner updates."""
    dtype = sampler_copy_dtype(config)
    if dtype is None:
        if config.algorithm.max_staleness > 0:  # it samples while the learner updates
            model = copy.deepcopy(model)
        return TorchBackend(model, tokenizer, autocast=autocast_dtype(config))
    device = next(model.parameters()).device
    m = config.model
    copied = load_model(model_path, dtype=dtype, device=device, attention=m.attention)
    weights_of = merged_state_dict if is_lora(model) else None
    backend = TorchBackend(copied, tokenizer, weights_of=weights_of)
    backend.sync(model)  # the warmed-up (or resumed) weights, not the directory's
    backend.policy_version = 0
    return backend


def _check_kind(checkpoint: Path, lora: bool) -> None:
    """Refuse to resume LoRA adapters as a whole model, or the other way round."""
    adapters = (checkpoint / "model" / ADAPTER_CONFIG).is_file()
    if adapters and not lora:
        raise ConfigError(
            f"{checkpoint} holds LoRA adapters: resume it with the model.lora settings it "
            "was trained with (model.lora.rank > 0)"
        )
    if lora and not adapters:
        raise ConfigError(
            f"{checkpoint} holds a whole model, not LoRA adapters: resume it with "
            "model.lora.rank = 0 (the setting it was trained with)"
        )


def _with_lora(config: Config, model: Any, run_dir: Path, checkpoint: Path | None) -> Any:
    """``model`` (the run's start policy) with the run's LoRA adapters: fresh ones, or
    those of ``checkpoint``."""
    if checkpoint is not None:
        return load_adapters(model, checkpoint / "model")
    lo = config.model.lora
    return add_lora(
        model, rank=lo.rank, alpha=lo.alpha, target_modules=lo.target_modules,
        dropout=lo.dropout, base_path=(run_dir / "start_model").resolve(),
    )  # fmt: skip


def _backend(config: Config, model: Any, tokenizer: Any, model_path: Path) -> Backend:
    """The sampling engine ``rollout.backend`` names, holding ``model``'s current weights."""
    if config.rollout.backend == "torch":
        return torch_sampler(config, model, tokenizer, model_path)
    engine = vllm_sampler(config, tokenizer, model_path, engine_weights)
    engine.load_weights(model)  # the warmed-up (or resumed) weights, not the directory's
    return engine


def vllm_sampler(
    config: Config,
    tokenizer: Any,
    model_path: Path,
    weights_of: Callable[[Any], Mapping[str, torch.Tensor]],
) -> VLLMBackend:
    """A vLLM engine built from ``model_path`` for ``config``'s rollouts (the run's seed,
    context length and precision); ``weights_of`` turns what ``load_weights`` and ``sync``
    are given into the weights to load. In asynchronous training it never sleeps: it
    samples while the learner updates, so releasing its memory between batches would give
    the learner nothing it could count on and cost a copy of the weights each batch."""
    from turnrl.backends.vllm_backend import VLLMBackend

    r = config.rollout
    return VLLMBackend(
        model_path, tokenizer, seed=config.seed,
        max_model_len=r.max_context_tokens + r.max_tokens_per_turn, weights_of=weights_of,
        dtype="bfloat16" if config.model.precision == "bf16-mixed" else "float32",
        sleep=False if config.algorithm.max_staleness > 0 else None,
    )  # fmt: skip


def engine_weights(model: Any) -> dict[str, torch.Tensor]:
    """The weights an engine samples ``model`` with, under the base model's names: a LoRA
    policy's adapters merged into its base weights, any other policy's state dict."""
    return merged_state_dict(model) if is_lora(model) else dict(model.state_dict())


def check_template(parts: RunParts, progress: bool = False) -> Row:
    """Before step 1: the chat template on a probe tool episode in the environment's call
    format (``template_report``). A tool result that would become control tokens, or ids
    that do not decode to the rendered text, stop the run; a template that rewrites
    history only warns (each tool episode is then split into per-turn samples, counted as
    ``rollout/template_breaks``)."""
    env = parts.family.make_env()
    call_format = env_format(env)
    if call_format is None:  # an environment without a tool-call format: nothing to probe
        return {}
    tools = _tool_schemas(parts, env)
    if tools is None:  # the environment's tools failed to build: its episodes will say why
        return {}
    report = template_report(
        parts.renderer, call_format, parts.sampling.stop_token_ids, tools=tools
    )
    if call_format.template_tools and not parts.renderer.template_tools:
        say(
            f"the model's chat template does not render tools: turnrl writes the "
            f"{call_format.name} tool list into the system turn, and the calls and results "
            "in that format on the template's own turns",
            progress,
        )
    if not (report.round_trip and report.observation_as_text):
        raise TemplateError(
            f"the model's chat template fails turnrl's start-up check with the "
            f"{call_format.name!r} call format: " + " ".join(report.problems)
        )
    if not report.prefix:
        say("warning: " + " ".join(report.problems), progress)
    return {
        "startup/template_prefix": float(report.prefix),
        "startup/template_round_trip": float(report.round_trip),
        "startup/observation_as_text": float(report.observation_as_text),
    }


def _tool_schemas(parts: RunParts, env: Env) -> list[Any] | None:
    """The tools ``env`` offers on the first test task (the probe calls the first one);
    none where they cannot be read without an episode (the probe then uses its own); None
    where building them fails: a bug in the environment is reported by its episodes, with
    the user's traceback and the failure policy (``rollout.max_error_frac``)."""
    if env_tools(env) is None:
        return []

    async def tools_of() -> list[Any] | None:
        try:
            await env.reset(
                parts.family.task(0, split="test"), derive_seed(parts.config.seed, "template")
            )
            tools = env_tools(env)
            return None if tools is None else list(tools.schemas())
        except Exception:
            return None
        finally:
            await close_env(env)

    return asyncio.run(tools_of())


def check_sampler(parts: RunParts) -> Row:
    """Before step 1: the engine's log-probs of a probe batch against the learner's (the
    rollout workers' engines where the run has them: those are what sample).

    A gap above ``rollout.startup_tolerance`` stops the run with what was measured: the
    importance weights would otherwise correct (or hide) an engine that samples from
    other numbers than the learner trains (another dtype or kernel, unsynced weights)."""
    c = parts.config
    tasks = [parts.family.task(i, split="test") for i in range(4)]
    probe = GroupSpec(2, parts.limits, parts.sampling, seed=derive_seed(c.seed, "startup"))
    groups = run_groups(parts, tasks, probe)
    samples = [s for g in groups for x in trainable(g) for s in x.samples()]
    if not samples:
        return {}
    gap = parts.learner.sampler_gap(samples, parts.backend.pad_id)
    if gap > c.rollout.startup_tolerance:
        raise BackendError(
            f"the sampler ({c.rollout.backend}) and the learner disagree before training: "
            f"log-probs of the same tokens differ by up to {gap:.3g} nats "
            f"(rollout.startup_tolerance = {c.rollout.startup_tolerance:g}). Check that "
            "both run the same weights in the same dtype; the gap would otherwise be "
            "trained on as if it were the policy's."
        )
    return {"startup/logprob_gap_max": gap}


def load_state(parts: RunParts, checkpoint: Path) -> int:
    """Restore the optimizer, the policy version and the critic from ``checkpoint``;
    return the step to continue from."""
    state = load_trainer_state(checkpoint, parts.learner.optimizer)
    parts.backend.policy_version = state.policy_version
    extra = load_extra(checkpoint)
    if parts.learner.critic is not None:
        if extra is None or "critic" not in extra:
            raise ConfigError(f"{checkpoint} has no critic state to resume PPO from")
        parts.learner.critic.load_state_dict(extra["critic"])
    return state.step


def say(message: str, progress: bool) -> None:
    """Print above the progress bar, or log when there is none."""
    if progress:
        tqdm.write(f"turnrl: {message}")
    else:
        logger.warning(message)


def tiny_model_config(config: Config) -> TinyModelConfig:
    """The tiny model a run with an empty ``model.path`` builds (its shape, echo tuning and
    the run's seed)."""
    m = config.model.tiny
    return TinyModelConfig(
        arch=m.arch,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        vocab_size=m.vocab_size,
        echo_steps=m.echo_steps,
        echo_novel=m.echo_novel,
        seed=config.seed,
    )


def _check_engine(config: Config) -> None:
    """What would stop a vLLM engine, said now, not after the minutes a tiny model's
    pretraining and the warm-up take: vLLM missing where the engines run on this Python (in
    this process, or on rollout workers of a local Ray cluster; a cluster's nodes at
    ``cluster.address`` have their own), and, on a CPU, heads its attention refuses (said
    first: a shape to fix whatever is installed)."""
    if config.rollout.backend != "vllm":
        return
    from turnrl.backends.vllm_backend import (
        check_cpu_head_size,
        cpu_head_size_problem,
        require_vllm,
    )

    m = config.model
    if not torch.cuda.is_available():
        if m.path:
            check_cpu_head_size(Path(m.path))
        else:
            shape = {"hidden_size": m.tiny.hidden_size, "num_attention_heads": m.tiny.num_heads}
            tiny = "the tiny model (model.tiny.hidden_size / num_heads)"
            problem = cpu_head_size_problem(shape, tiny)
            if problem:
                raise ConfigError(problem)
    if not (config.cluster.rollout_workers and config.cluster.address):
        require_vllm()


def _base_model(config: Config, spec: EnvFamily, run_dir: Path, progress: bool) -> Path:
    if config.model.path:  # a GGUF file or a named model: its imported checkpoint
        return Path(resolve_model(config.model.path, say=lambda m: say(m, progress)))
    tiny = tiny_model_config(config)
    target = run_dir / "base_model"
    if (target / "config.json").is_file():
        return target
    return Path(build_tiny_model(target, tiny, extra_corpus=spec.corpus(), progress=progress))


def _warmup(
    config: Config,
    spec: EnvFamily,
    model: Any,
    tokenizer: Any,
    renderer: ChatRenderer,
    limits: EpisodeLimits,
    sampling: SamplingParams,
    progress: bool,
) -> Row:
    t0 = time.perf_counter()
    w = config.warmup
    demos = demonstration_trajectories(
        spec, tokenizer, renderer, count=min(w.steps * w.batch_size, 4096),
        limits=limits, sampling=sampling, seed=config.seed,
    )  # fmt: skip
    check_failures(demos, config.rollout.max_error_frac, where="warm-up demonstrations")
    samples = warmup_samples(demos)
    if not samples:
        raise ConfigError("the warm-up demonstrations produced no trainable samples")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    losses = supervised_warmup(
        model, samples, w, pad_id=int(pad), seed=config.seed, progress=progress
    )
    return {
        "warmup/loss_first": losses[0],
        "warmup/loss_last": losses[-1],
        "warmup/demonstrations": float(len(demos)),
        "warmup/s": time.perf_counter() - t0,
    }
