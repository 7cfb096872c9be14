"""The learner's GPU-path settings, checked on the CPU: ``model.precision = bf16-mixed``
keeps float32 master weights and autocasts the compute; the torch sampler then holds a
bf16 copy, refreshed after every update (a LoRA policy merged into it); gradient
checkpointing gives the same gradients; the attention kernel is the one asked for;
``model.device`` is checked."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SMALL_RUN
from test_learner import algo, rollout_batch
from turnrl.backends.torch_backend import TorchBackend
from turnrl.errors import ConfigError
from turnrl.models import load_model
from turnrl.models.lora import add_lora, is_lora, merged_state_dict
from turnrl.trainer.config import inert_settings, load_config, resolved
from turnrl.trainer.forward import token_logprobs
from turnrl.trainer.learner import Learner
from turnrl.trainer.loop import train
from turnrl.trainer.startup import checkpoint_activations, torch_sampler


def test_bf16_mixed_keeps_float32_master_weights_and_autocasts_the_compute(
    model: Any, tokenizer: Any
) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    learner = Learner(model, algo(lr=1e-2), temperature=1.0, autocast=torch.bfloat16)
    seen: list[torch.dtype] = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda _m, _i, out: seen.append(out.dtype)
    )
    before = [p.detach().clone() for p in model.parameters()]
    try:
        learner.step(batch)
    finally:
        hook.remove()
    assert seen
    assert set(seen) == {torch.bfloat16}  # the matmuls ran in bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    states = [s for s in learner.optimizer.state.values() if "exp_avg" in s]
    assert states
    assert all(s["exp_avg"].dtype == torch.float32 for s in states)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with learner.autocasting():
        logprobs, _ = token_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0
        )
    assert logprobs.dtype == torch.float32  # log-probs and losses in float32


def test_bf16_sampler_and_learner_agree_to_bf16_rounding(model: Any, tokenizer: Any) -> None:
    """The torch sampler under the same autocast: close to the learner (within the bf16
    start-up tolerance). bf16's own rounding is far above float32's, which is why the
    tolerance depends on it; how much of it shows between the sampler's and the learner's
    passes depends on the CPU's kernels (ATen's scalar ``default`` kernels give both the
    same numbers, a gap of 0), so that gap is held only to its upper bound."""
    learner = Learner(model, algo(), temperature=1.0, autocast=torch.bfloat16)
    backend = TorchBackend(model, tokenizer, autocast=torch.bfloat16)
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)  # float32 sampler: the gap
    with torch.no_grad():
        ours, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rounded, _ = token_logprobs(
                model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0
            )
    samples_gap = float((ours - batch.old_logprobs).abs()[batch.loss_mask].max())
    assert samples_gap < 1e-4  # float32 sampler vs float32 learner
    bf16_rounding = float((rounded - ours).abs()[batch.loss_mask].max())
    assert bf16_rounding > 5e-4  # what bf16 does to the log-probs, on any CPU
    from test_learner import SPEC  # the probe environment
    from turnrl.models.loading import stop_token_ids
    from turnrl.rollout.chat import ChatRenderer
    from turnrl.rollout.episode import EpisodeLimits, SamplingParams
    from turnrl.rollout.groups import GroupSpec, collect_groups

    spec = GroupSpec(
        2, EpisodeLimits(max_tokens_per_turn=24),
        SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=3,
    )  # fmt: skip
    groups = backend.run(
        collect_groups([SPEC.task(i) for i in range(2)], SPEC.make_env, backend,
                       ChatRenderer(tokenizer), spec)
    )  # fmt: skip
    samples = [s for g in groups for t in g for s in t.samples()]
    gap = learner.sampler_gap(samples, backend.pad_id)
    tolerance = resolved(load_config(None, ["model.precision=bf16-mixed"])).rollout
    assert 0.0 <= gap < tolerance.startup_tolerance
    assert tolerance.startup_tolerance > bf16_rounding  # the tolerance covers bf16's rounding


def _collect(backend: TorchBackend, tokenizer: Any, seed: int = 3) -> list[Any]:
    """Two groups of two probe episodes sampled by ``backend``: its trainable samples."""
    from test_learner import SPEC  # the probe environment
    from turnrl.models.loading import stop_token_ids
    from turnrl.rollout.chat import ChatRenderer
    from turnrl.rollout.episode import EpisodeLimits, SamplingParams
    from turnrl.rollout.groups import GroupSpec, collect_groups

    spec = GroupSpec(
        2, EpisodeLimits(max_tokens_per_turn=24),
        SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=seed,
    )  # fmt: skip
    groups = backend.run(
        collect_groups([SPEC.task(i) for i in range(2)], SPEC.make_env, backend,
                       ChatRenderer(tokenizer), spec)
    )  # fmt: skip
    return [s for g in groups for t in g for s in t.samples()]


def _holds(backend: TorchBackend, weights: dict[str, torch.Tensor]) -> bool:
    """The sampler's weights are exactly ``weights`` cast to its bf16."""
    own = backend.model.state_dict()
    return all(torch.equal(own[k], v.to(torch.bfloat16)) for k, v in weights.items())


def test_the_bf16_sampler_holds_a_bf16_copy_refreshed_after_every_update(
    model: Any, tokenizer: Any, tiny_model_dir: Path
) -> None:
    config = resolved(load_config(None, ["model.precision=bf16-mixed"]))
    assert config.rollout.sampler_weights == "bf16"  # auto under bf16-mixed
    assert config.algorithm.off_policy.correction == "token_tis"  # other numerics
    backend = torch_sampler(config, model, tokenizer, tiny_model_dir)
    assert backend.model is not model
    assert backend.autocast is None
    assert {p.dtype for p in backend.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the master weights
    assert backend.policy_version == 0
    assert _holds(backend, model.state_dict())
    learner = Learner(model, algo(lr=1e-2), temperature=1.0, autocast=torch.bfloat16)
    samples = _collect(backend, tokenizer)
    gap = learner.sampler_gap(samples, backend.pad_id)
    assert 1e-5 < gap < config.rollout.startup_tolerance  # bf16 rounding, not float32-close
    learner.step(rollout_batch(model, tokenizer, tasks=2, group=2))
    assert not _holds(backend, model.state_dict())  # the update moved the master weights
    backend.sync(model)
    assert backend.policy_version == 1
    assert _holds(backend, model.state_dict())
    after = learner.sampler_gap(_collect(backend, tokenizer, seed=4), backend.pad_id)
    assert after < config.rollout.startup_tolerance


def test_a_lora_policy_is_merged_into_the_bf16_sampler(
    tokenizer: Any, tiny_model_dir: Path
) -> None:
    policy = add_lora(load_model(tiny_model_dir), rank=4, alpha=8.0, target_modules=["all-linear"])
    with torch.no_grad():  # trained-looking adapters: B is zero at initialisation
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(0))
    config = resolved(load_config(None, ["model.lora.rank=4", "rollout.sampler_weights=bf16"]))
    assert config.rollout.startup_tolerance == 0.1  # float32 learner, bf16 sampler
    backend = torch_sampler(config, policy, tokenizer, tiny_model_dir)
    assert not is_lora(backend.model)  # plain weights: the adapters cost sampling nothing
    merged = merged_state_dict(policy)
    assert _holds(backend, merged)
    assert not _holds(backend, load_model(tiny_model_dir).state_dict())  # not the base
    learner = Learner(policy, algo(lr=1e-2), temperature=1.0)
    assert learner.sampler_gap(_collect(backend, tokenizer), backend.pad_id) < 0.1
    learner.step(rollout_batch(policy, tokenizer, tasks=2, group=2))
    backend.sync(policy)
    assert _holds(backend, merged_state_dict(policy))
    assert not _holds(backend, merged)


def test_sampler_weights_settings() -> None:
    plain = resolved(load_config(None, []))
    assert plain.rollout.sampler_weights == "shared"
    assert plain.algorithm.off_policy.correction == "none"
    assert plain.rollout.startup_tolerance == 1e-3
    shared = resolved(
        load_config(None, ["model.precision=bf16-mixed", "rollout.sampler_weights=shared"])
    )
    assert shared.algorithm.off_policy.correction == "none"  # the learner's own model
    assert not inert_settings(load_config(None, ["rollout.sampler_weights=bf16"]))
    vllm = load_config(None, ["rollout.backend=vllm", "rollout.sampler_weights=bf16"])
    assert any("sampler_weights" in m for m in inert_settings(vllm))
    plain_vllm = resolved(load_config(None, ["rollout.backend=vllm"]))
    assert plain_vllm.rollout.sampler_weights == "auto"  # nothing to choose: no warning
    assert not any("sampler_weights" in m for m in inert_settings(plain_vllm))
    with pytest.raises(ConfigError, match="sampler_weights"):
        load_config(None, ["rollout.sampler_weights=fp16"])


def test_gradient_checkpointing_gives_the_same_gradients(model: Any, tokenizer: Any) -> None:
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    plain = copy.deepcopy(model)
    checkpoint_activations(model)
    layer = model.model.layers[0]
    checkpoint, calls = layer._gradient_checkpointing_func, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return checkpoint(*args, **kwargs)

    layer._gradient_checkpointing_func = counting
    grads = []
    for m in (model, plain):
        learner = Learner(m, algo(lr=1e-2), temperature=1.0)
        learner.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
        learner.step(batch)
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert calls  # the learner's forward ran the layer through the checkpoint
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6, rtol=1e-4), name


def test_the_attention_kernel_is_the_one_asked_for(tiny_model_dir: Path, tokenizer: Any) -> None:
    eager = load_model(tiny_model_dir, attention="eager")
    sdpa = load_model(tiny_model_dir, attention="sdpa")
    assert eager.config._attn_implementation == "eager"
    assert sdpa.config._attn_implementation == "sdpa"
    batch = rollout_batch(sdpa, tokenizer, tasks=2, group=2)
    args = (batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0)
    with torch.no_grad():
        a, _ = token_logprobs(eager, *args)
        b, _ = token_logprobs(sdpa, *args)
    assert (a - b).abs().max() < 1e-5


def test_a_run_with_the_gpu_path_settings_on_the_cpu(tmp_path: Path) -> None:
    settings = ["model.precision=bf16-mixed", "model.gradient_checkpointing=true",
                "model.attention=eager", "model.device=cpu"]  # fmt: skip
    result = train(load_config(None, [*SMALL_RUN, *settings]), tmp_path / "run", progress=False)
    first = result.rows[0]
    assert 0.0 < first["startup/logprob_gap_max"] < 0.1  # the bf16 sampler's rounding
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["rollout"]["sampler_weights"] == "bf16"
    assert len(result.rows) == 3
    with pytest.raises(ConfigError, match=r"model\.device"):
        load_config(None, ["model.device=gpu"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            train(
                load_config(None, [*SMALL_RUN, "model.device=cuda"]), tmp_path / "x", progress=False
            )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bf16_run_on_the_gpu(tmp_path: Path) -> None:
    settings = ["model.precision=bf16-mixed", "model.gradient_checkpointing=true"]
    result = train(load_config(None, [*SMALL_RUN, *settings]), tmp_path / "run", progress=False)
    assert result.rows[0]["startup/logprob_gap_max"] < 0.1
    assert torch.cuda.max_memory_allocated() > 0
