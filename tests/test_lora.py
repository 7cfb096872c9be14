"""LoRA (``model.lora``): only the adapters train and are saved; the reference is the base
with adapters off; merged weights equal the adapted model; a resumed LoRA run is the same
run; ``turnrl export`` writes a merged model any transformers user can load."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SMALL_RUN
from test_learner import algo, rollout_batch
from turnrl.cli import main
from turnrl.errors import ConfigError
from turnrl.models import load_model
from turnrl.models.lora import (
    adapter_plan,
    adapters_off,
    add_lora,
    is_lora,
    load_adapters,
    merge_adapters,
    merged_state_dict,
    save_adapters,
)
from turnrl.trainer.config import load_config
from turnrl.trainer.forward import token_logprobs
from turnrl.trainer.learner import Learner
from turnrl.trainer.loop import train

IDS = torch.tensor([[5, 17, 40, 9, 33, 21, 8, 60]])


def moved_off_zero(model: Any, seed: int = 0) -> Any:
    """``model``'s adapters drawn away from their zero start: B, and an embedding's A
    (peft starts those at zero instead)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def lora_model(model_dir: Path, rank: int = 4, seed: int = 0) -> Any:
    """The tiny model with rank-``rank`` adapters moved off their zero start (B != 0), so
    adapted and base policies differ."""
    model = add_lora(load_model(model_dir), rank=rank, alpha=8.0, target_modules=["all-linear"])
    return moved_off_zero(model, seed)


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(IDS).logits
    return out


def test_only_the_adapters_get_gradients_and_updates(tiny_model_dir: Path, tokenizer: Any) -> None:
    model = lora_model(tiny_model_dir)
    base_before = {n: p.clone() for n, p in model.named_parameters() if "lora_" not in n}
    adapters_before = {n: p.clone() for n, p in model.named_parameters() if "lora_" in n}
    assert adapters_before
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    learner = Learner(model, algo(lr=1e-2), temperature=1.0, max_length=64)
    held = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if "lora_" in n}
    learner.step(rollout_batch(model, tokenizer, tasks=2, group=2))
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads
    assert all("lora_" in n for n in grads)
    for name, p in model.named_parameters():
        if name in base_before:
            assert torch.equal(p, base_before[name]), name
    moved = [
        n
        for n, p in model.named_parameters()
        if n in adapters_before and not torch.equal(p, adapters_before[n])
    ]
    assert moved, "the update changed no adapter"


def test_merged_weights_give_the_adapted_model(tiny_model_dir: Path) -> None:
    model = lora_model(tiny_model_dir)
    merged = load_model(tiny_model_dir)
    missing, unexpected = merged.load_state_dict(merged_state_dict(model), strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    adapted, plain = logits(model), logits(merged)
    assert (adapted - logits(load_model(tiny_model_dir))).abs().max() > 1e-3  # B != 0 matters
    assert (adapted - plain).abs().max() < 1e-5
    assert is_lora(model)
    assert not is_lora(merged)


def peft_merged(model: Any) -> dict[str, torch.Tensor]:
    """peft's own merge of ``model``'s adapters (``merge_and_unload``), on a copy."""
    import copy

    import peft

    wrapped = peft.PeftModel(copy.deepcopy(model), model.peft_config["default"])
    wrapped.load_state_dict(
        {f"base_model.model.{k}": v for k, v in model.state_dict().items()}, strict=True
    )
    return dict(wrapped.merge_and_unload().state_dict())


@pytest.mark.parametrize("kind", ["qwen2 all-linear", "gpt2 conv1d", "embedding"])
def test_the_merge_is_peft_s_own(kind: str, tiny_model_dir: Path) -> None:
    """``merged_state_dict`` equals peft's ``merge_and_unload`` on the weights, for linear
    layers, GPT-2's Conv1D (its weight stored transposed: ``fan_in_fan_out``) and an
    embedding's adapter (peft's ``lora_embedding_A``/``B``)."""
    if kind == "gpt2 conv1d":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        base = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64))
        targets = ["c_attn", "c_fc"]
    elif kind == "embedding":  # untied: an adapter on a tied embedding is refused
        base = load_model(tiny_model_dir)
        base.config.tie_word_embeddings = False
        base.lm_head.weight = torch.nn.Parameter(base.lm_head.weight.detach().clone())
        targets = ["embed_tokens", "q_proj"]
    else:
        base = load_model(tiny_model_dir)
        targets = ["all-linear"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's note that Conv1D needs fan_in_fan_out
        model = moved_off_zero(add_lora(base, rank=4, alpha=8.0, target_modules=targets))
        expected = peft_merged(model)
    got = merged_state_dict(model)
    assert got.keys() == expected.keys()
    assert all(torch.allclose(got[k], expected[k], atol=1e-6) for k in got)
    unmerged = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()}
    moved = [k for k in got if (got[k] - unmerged[k]).abs().max() > 1e-3]
    plan = adapter_plan(model)
    assert sorted(moved) == sorted(k.replace(".base_layer.", ".") for k in plan)
    if kind == "gpt2 conv1d":
        assert all(transposed for _, _, _, transposed in plan.values())
    if kind == "embedding":
        assert "model.embed_tokens.weight" in moved


def test_an_adapter_on_a_tied_embedding_is_refused(tiny_model_dir: Path) -> None:
    """The tiny model's input embedding is its output layer: an adapter there would move
    the lookup and not the logits, and no merged model would be the policy."""
    with pytest.raises(
        ConfigError,
        match=r"model.embed_tokens.base_layer.weight and "
        r"lm_head.weight are one weight \(tied\)",
    ):
        add_lora(load_model(tiny_model_dir), rank=4, alpha=8.0, target_modules=["embed_tokens"])


def test_a_lora_weight_the_plan_does_not_cover_is_an_error(tiny_model_dir: Path) -> None:
    model = lora_model(tiny_model_dir)
    plan = adapter_plan(model)
    dropped = next(iter(plan))
    with pytest.raises(ValueError, match="belongs to no adapted weight"):
        merge_adapters(dict(model.state_dict()), {k: v for k, v in plan.items() if k != dropped})


def test_the_reference_is_the_base_with_adapters_off(tiny_model_dir: Path, tokenizer: Any) -> None:
    model = lora_model(tiny_model_dir)
    base = logits(load_model(tiny_model_dir))
    with adapters_off(model) as off:
        assert (logits(off) - base).abs().max() < 1e-6
    assert (logits(model) - base).abs().max() > 1e-3  # adapters back on afterwards
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    learner = Learner(model, algo(kl__coef=0.1, lr=1e-2), temperature=1.0, max_length=64)
    assert learner.ref_is_base
    assert learner.ref_model is None  # no second copy of the model
    batch = rollout_batch(model, tokenizer, tasks=2, group=2)
    mask = batch.loss_mask
    with learner.reference() as reference:
        ref, _ = token_logprobs(reference, batch.input_ids, batch.attention_mask, mask, 1.0)
    plain, _ = token_logprobs(
        load_model(tiny_model_dir), batch.input_ids, batch.attention_mask, mask, 1.0
    )
    assert (ref - plain).abs().max() < 1e-5
    metrics = learner.step(batch)
    assert metrics["loss/kl"] > 1e-5  # the adapted policy differs from its base


def test_switching_adapters_off_leaves_every_requires_grad_flag_as_it_was(
    tiny_model_dir: Path,
) -> None:
    """peft's switch flips the adapters' flags off and on; under FSDP2 that landed on
    other tensors than it started from and froze the sharded adapters (LoRA with a KL on
    learner ranks then had no gradient in a step's second epoch)."""
    model = lora_model(tiny_model_dir)
    frozen = next(p for n, p in model.named_parameters() if "lora_A" in n)
    frozen.requires_grad_(False)  # e.g. an adapter its owner froze on purpose
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    assert any(before.values())
    assert not all(before.values())
    with adapters_off(model):
        assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before


def test_adapters_round_trip_through_peft_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = lora_model(tiny_model_dir)
    save_adapters(model, tmp_path / "adapters")
    assert {p.name for p in (tmp_path / "adapters").iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft warns on missing adapter keys
        loaded = load_adapters(load_model(tiny_model_dir), tmp_path / "adapters")
    assert (logits(loaded) - logits(model)).abs().max() == 0.0
    assert all(p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n)


def test_a_bad_target_module_is_a_config_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.lora"):
        add_lora(load_model(tiny_model_dir), rank=2, alpha=4.0, target_modules=["no_such_proj"])
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        load_config(None, ["model.lora.rank=-1"])
    with pytest.raises(ConfigError, match="list of strings"):
        load_config(None, ["model.lora.target_modules=3"])
    config = load_config(None, ['model.lora.target_modules=["q_proj", "v_proj"]'])
    assert config.model.lora.target_modules == ("q_proj", "v_proj")


# an entropy bonus: a gradient even where every group's rewards are equal (the tiny run's)
LORA_RUN = [*SMALL_RUN, "model.lora.rank=4", "model.lora.alpha=8", "algorithm.lr=0.02",
            "algorithm.entropy_coef=0.05", "model.device=cpu"]  # fmt: skip
"""On the CPU also where there is a GPU: bit-exact resume needs deterministic kernels, and
two identical runs on CUDA already differ (seen on an H200, 2026-11-26)."""


def test_a_lora_run_saves_adapters_resumes_exactly_and_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    four = load_config(None, [*LORA_RUN, "steps=4"])
    assert four.algorithm.kl.coef > 0  # the reference (base, adapters off) is exercised
    straight = tmp_path / "straight"
    train(four, straight, progress=False)
    stopped = tmp_path / "stopped"
    train(load_config(None, LORA_RUN), stopped, progress=False)  # stops after step 2
    saved = stopped / "checkpoints" / "step_000002" / "model"
    assert (saved / "adapter_config.json").is_file()
    assert not (saved / "model.safetensors").exists()  # only the adapters
    assert json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        str((stopped / "start_model").resolve())
    )
    train(four, stopped, resume=True, progress=False)

    def rows(run: Path) -> list[dict[str, Any]]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [
            {
                k: v
                for k, v in json.loads(x).items()
                if not k.startswith("perf/") and k != "warmup/s"
            }
            for x in lines
        ]

    assert rows(stopped) == rows(straight)
    assert rows(stopped)[-1]["train/grad_norm"] > 0  # the adapters were trained
    assert rows(stopped)[-1]["loss/kl"] > 0  # away from their base, the reference

    # export: one merged model, equal to the trained policy (base + adapters)
    out = tmp_path / "exported"
    assert main(["export", str(stopped), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    exported = load_model(out)
    assert not (out / "adapter_config.json").exists()
    policy = load_adapters(
        load_model(stopped / "start_model"), stopped / "checkpoints" / "step_000004" / "model"
    )
    assert (logits(exported) - logits(policy)).abs().max() < 1e-5
    assert (logits(exported) - logits(load_model(stopped / "start_model"))).abs().max() > 1e-6
    # a LoRA checkpoint directory also loads directly (merged), e.g. for `turnrl eval`
    direct = load_model(stopped / "checkpoints" / "step_000004" / "model")
    assert (logits(direct) - logits(exported)).abs().max() < 1e-5

    # and the errors: an occupied output, nothing to export, a whole-model checkpoint
    assert main(["export", str(stopped), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "x")]) == 2
    assert "nothing to export" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="LoRA adapters"):
        train(
            load_config(None, [*LORA_RUN, "model.lora.rank=0", "steps=5"]),
            stopped,
            resume=True,
            progress=False,
        )
