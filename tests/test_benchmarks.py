"""Every benchmark script runs end to end in its ``--smoke`` mode (the real code path on
tiny settings, in a subprocess) and writes what a real run writes: the results JSON with
the rows, keys and cases expected and every number finite, and the markdown table; and
nothing lands in benchmarks/results or benchmarks/runs."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import swe_tests_can_run
from turnrl.envs.swe import runner as swe_runner

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
Check = Callable[[dict[str, Any], Path], None]


def scripts() -> list[str]:
    """The runnable scripts of benchmarks/ (the other modules are what they share)."""
    return sorted(
        p.stem for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()
    )


def finite_numbers(value: Any, where: str = "") -> list[str]:
    """The places in a JSON value holding a number that is not finite."""
    if isinstance(value, dict):
        return [bad for k, v in value.items() for bad in finite_numbers(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [bad for i, v in enumerate(value) for bad in finite_numbers(v, f"{where}[{i}]")]
    if isinstance(value, float) and not math.isfinite(value):
        return [where]
    return []


def files_under(*folders: Path) -> dict[Path, int]:
    """Every file below ``folders`` with its modification time."""
    return {p: p.stat().st_mtime_ns for f in folders for p in f.rglob("*") if p.is_file()}


def curve_ok(curve: list[list[float]], steps: int) -> None:
    assert curve, "no evaluation"
    assert [s for s, _, _ in curve][-1] == steps
    assert all(0.0 <= v <= 1.0 for _, _, v in curve)


# --------------------------------------------------------------------------- per script


def bf16_gradients(data: dict[str, Any], tmp: Path) -> None:
    assert data["steps"] == 2 == len(data["runs"])
    assert Path(data["run_dir"]).is_relative_to(tmp)
    curve_ok([(s, 0.0, v) for s, v in data["curve"]], 2)
    for row in data["runs"]:
        # bf16 and float32 gradients of one batch: close, but not equal
        assert 0.5 < row["grad_cosine"] <= 1.0 + 1e-9
        assert 0.0 < row["grad_relative_error"] < 1.0
        assert -1.0 <= row["adam_update_cosine"] <= 1.0 + 1e-9
        assert row["halves_cosine"] is None or -1.0 <= row["halves_cosine"] <= 1.0 + 1e-9
        assert row["grad_norm"] > 0
    assert set(data["summary"]) >= {"grad_cosine", "grad_relative_error", "adam_update_cosine"}


def copying(data: dict[str, Any], tmp: Path) -> None:
    assert data["num_words"] == 3
    (row,) = data["runs"]
    assert (row["echo_steps"], row["echo_novel"]) == (4, 0.5)
    assert Path(row["model"]).is_relative_to(tmp)
    assert row["echo_loss_last"] > 0
    for key in ("made_up", "names", "names_in_sentence"):
        assert row[key] in (0.0, 1 / 3, 2 / 3, 1.0), key
    assert row["tokens_per_name"] >= 1


def env_learning(data: dict[str, Any], tmp: Path) -> None:
    rows = data["runs"]
    recipes = ["search_qa", "frozen_lake", "frozen_lake", "bandit", "examples/atlas.py"]
    assert [r["recipe"] for r in rows] == recipes
    for number, r in enumerate(rows):
        assert "steps=2" in r["overrides"]
        assert r["steps"] == 2
        curve_ok(r["curve"], 2)
        assert r["best_success"] == max(v for _, _, v in r["curve"])
        assert (tmp / "runs" / f"env-{number}-{Path(r['recipe']).stem}").is_dir()
    assert rows[3]["chance"] == 0.5  # the bandit's two arms
    assert rows[4]["env"] == "atlas"  # an example: the user's environment, public API


def envs(data: dict[str, Any], tmp: Path) -> None:
    rows = data["rows"]
    assert [r["env"] for r in rows] == [
        "sokoban", "sokoban", "frozen_lake", "frozen_lake", "bandit", "secret_lookup",
        "search_qa", "search_qa", "search_qa", "shop", "service", "tool_math", "swe",
    ]  # fmt: skip
    for r in rows:
        assert r["tasks"] == 2
        assert r["oracle_ok"], r
        assert r["random_low"], r
        assert r["random_episodes_per_s"] > 0
        assert r["oracle_episodes_per_s"] is None or r["oracle_episodes_per_s"] > 0
    assert rows[-1]["options"] == {"libraries": ["toolz"], "num_bugs": 3}


def learner(data: dict[str, Any], tmp: Path) -> None:
    rows = data["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [
        ("tiny (64 x 2)", "agent"), ("tiny (64 x 2)", "varied"),
    ]  # fmt: skip
    for r in rows:
        assert set(r["step_s"]) == {"padded", "padded + shared prefix", "packed", "auto"}
        assert all(s > 0 for s in r["step_s"].values())
        assert r["tokens"] <= r["packed_cells"] <= r["padded_cells"]


def learning_proof(data: dict[str, Any], tmp: Path) -> None:
    rows = data["runs"]
    assert [r["label"] for r in rows] == ["seed0", "control-no-tools", "control-shuffled-rewards"]
    for r in rows:
        assert r["chance"] == pytest.approx(1 / 12)
        assert r["steps"] == 2
        curve_ok(r["curve"], 2)
        assert Path(r["run_dir"]).is_relative_to(tmp)
        assert (Path(r["run_dir"]) / "trajectories.jsonl").is_file()


def presets(data: dict[str, Any], tmp: Path) -> None:
    assert data["echo_steps"] == 2
    assert "seed" not in data  # the seeds are the rows'
    rows = data["runs"]
    assert [(r["preset"], r["seed"]) for r in rows] == [
        ("grpo", 0), ("grpo", 1), ("ppo", 0), ("ppo", 1)
    ]  # fmt: skip
    for r in rows:
        assert r["variant"] == ""
        assert r["steps"] == 2
        curve_ok(r["curve"], 2)
    for seed in (0, 1):
        assert (tmp / "runs" / f"warmup-seed{seed}-echo2" / "start_model" / "config.json").is_file()
        assert (tmp / "runs" / f"preset-grpo-seed{seed}" / "metrics.jsonl").is_file()
    summary = (tmp / "presets.md").read_text()
    assert "| grpo | 0 / 1 |" in summary  # one summary row per preset, every seed in it


def real_model(data: dict[str, Any], tmp: Path) -> None:
    assert data["model"] == "tiny (--smoke)"
    rows = data["runs"]
    assert [(r["task"], r["label"]) for r in rows] == [
        ("search_qa", "seed0"), ("search_qa", "no-warmup"),
        ("tool_math", "seed0"), ("tool_math", "no-warmup"),
    ]  # fmt: skip
    for r in rows:
        assert r["steps"] == 1
        curve_ok(r["curve"], 1)
        assert r["target"] >= 0.6
        assert Path(r["run_dir"]).is_relative_to(tmp)
    assert rows[0]["warmup_s"] > 0
    assert rows[1]["warmup_s"] == 0
    assert set(rows[0]["episodes"]) == {"first", "last"}
    assert rows[0]["episodes"]["first"]["turns"][0]["role"] == "assistant"


def real_model_speed(data: dict[str, Any], tmp: Path) -> None:
    assert data["model"] == "tiny (--smoke)"
    assert data["repeats"] == 1
    sections = ["sampler", "update", "lora", "bf16", "profile", "scaling"]
    for name in sections:
        assert "error" not in data[name], (name, data[name].get("error"))
        c = data[name]["conditions"]
        assert len(c["load_before"]) == len(c["load_after"]) == 3
        assert c["torch_threads"] >= 1
        assert c["cpu"]
        assert isinstance(c["cpu_flags"], list)
    s = data["sampler"]
    assert s["requests"] == 16
    assert {"hf-generate-16", "hf-generate-1", "turnrl-torch"} <= set(s["samplers"])
    for r in s["samplers"].values():  # every sampler does the whole work
        assert r["tokens"] == s["requests"] * s["new_tokens"]
        assert r["tokens_per_s"] > 0
    assert s["ratios"]["torch_over_hf16"]["median"] > 0
    if "skipped" in s["vllm"]:  # .venv: no vLLM, its parts recorded as skipped
        assert not {"raw-vllm", "turnrl-vllm"} & set(s["samplers"])
        assert "skipped" in s["sync"]
        assert s["targets"]["vllm_over_raw_at_least_1"] is None
    else:  # .venv-vllm: raw vLLM and turnrl's on one engine, the sweep and the sync
        assert {"raw-vllm", "raw-vllm-ids", "turnrl-vllm"} <= set(s["samplers"])
        assert all("turnrl-vllm" in r["samplers"] for r in s["concurrency"]["rows"])
        assert s["sync"]["load_weights_s"] > 0
    assert [r["requests"] for r in s["concurrency"]["rows"]] == [4, 8]
    u = data["update"]
    assert set(u["steps"]) == {
        "turnrl", "bare", "bare-sliced", "turnrl-reference-forward", "bare-reference-forward",
        "bare-sliced-reference-forward",
    }  # fmt: skip
    assert u["batch"]["samples"] == 16
    assert 0 < u["batch"]["trained_tokens"] < u["batch"]["tokens"]
    assert u["ratio_turnrl_over_bare"]["median"] > 0
    assert u["ratio_turnrl_over_bare_sliced"]["median"] > 0  # the target's
    memories = [*u["memory"].values(), *data["lora"]["memory"].values()]
    assert len(memories) == 8
    for m in memories:
        assert "error" not in m, m
        assert m["peak_rss_mb"] >= m["baseline_rss_mb"]
        assert m["baseline_rss_mb"] > 0
        assert m["vocabulary_tensors_after_step"]["probe_found"]  # the scan sees such tensors
    lora = data["lora"]
    assert 0 < lora["trainable_parameters"] < lora["parameters"]
    assert lora["memory"]["lora"]["trainable_parameters"] == lora["trainable_parameters"]
    if "skipped" not in data["bf16"]:
        assert data["bf16"]["gap"]["float32"]["max_abs_gap"] < 1e-3
    for part in ("sampler", "update"):
        p = data["profile"][part]
        assert 1 <= len(p["top"]) <= 15
        assert sum(p["buckets"].values()) == pytest.approx(1.0)
    rows = data["scaling"]["rows"]
    assert len(rows) == 2
    assert all(r["parameters"] > 0 for r in rows)
    assert all(r["update_step_s"] > 0 for r in rows)


def reliability(data: dict[str, Any], tmp: Path) -> None:
    killed = data["kills"]
    assert [k["attempt"] for k in killed["kills"]] == [0, 1]
    assert all(k["killed"] for k in killed["kills"]), killed["kills"]
    assert killed["kills"][0]["resumed_from"] is None
    assert killed["metrics_equal"]
    assert killed["files_one_record_per_step"] == dict.fromkeys(
        ["metrics.jsonl", "trajectories.jsonl", "alarms.jsonl", "tensorboard"], True
    )
    fell_back, none_left = data["damages"]
    assert (fell_back["returncode"], fell_back["resumed_from"]) == (0, 4)
    assert "model/model.safetensors has" in fell_back["named"][0]
    assert fell_back["metrics_equal"]
    assert all(fell_back["files_one_record_per_step"].values())
    assert none_left["returncode"] == 2
    assert "no usable checkpoint" in none_left["named"][-1]
    # the fault injection that reaches inside (aimed kills, a full disk, load, fuzzing,
    # hostile code) is tests/test_fault_injection.py's, test_fuzz.py's, test_sandbox_hostile.py's


def rollout(data: dict[str, Any], tmp: Path) -> None:
    cells = data["cells"]
    # 2 batch sizes x 1 or 3 calls x 0 or 500 ms, the jitter and long-prompt cells; without
    # history reuse, the 3 instant cells of 4 episodes; the wider model with and without
    assert len(cells) == 10 + 3 + 2
    assert sorted({c["episodes"] for c in cells}) == [1, 4]
    for c in cells:
        assert c["wall_s"] > 0
        assert c["sampled_tokens"] > 0
        assert c["template_breaks"] == 0  # each turn ends as the chat template expects
        # every later turn reuses the cached history, exactly when reuse is on
        assert c["history_hits"] == (c["later_turns"] if c["history_reuse"] else 0), c
    target = data["latency_target"]
    assert target["bound_s"] == pytest.approx(1.3 * (target["instant_s"] + 1.5))
    assert target["tool_500ms_s"] >= 1.5  # three 500 ms calls, one after another


def tools(data: dict[str, Any], tmp: Path) -> None:
    modes = [r["mode"] for r in data["sandbox"]]
    assert modes == ["bwrap", "rlimit", "bare subprocess (peer, no isolation)"]
    for r in data["sandbox"]:
        if "unavailable" not in r:
            assert r["cold"]["median_ms"] > 0
            assert set(r["calls_per_s"]) == {"1", "2"}
    assert data["sandbox"][1].get("unavailable") is None  # rlimits work everywhere
    (search,) = data["search"]
    assert search["documents"] == 500
    assert search["queries_per_s_tool"] > 0
    assert [r["transport"] for r in data["mcp"]] == ["stdio", "streamable HTTP"]
    assert all(r["calls_per_s_16"] > 0 for r in data["mcp"])


def vs_trl(data: dict[str, Any], tmp: Path) -> None:
    assert set(data["cases"]) == {"single", "multi", "real"}
    for name, case in data["cases"].items():
        assert case["floor_s"] > 0
        for side in ("trl", "turnrl"):
            s = case[side]
            assert s["steps_timed"] == 1, (name, side)
            assert s["step_s"] > 0
            assert s["generated_tokens_per_s"] > 0
            assert s["completion_tokens_mean"] > 0
        assert case["ratio_step_turnrl_over_trl"] == pytest.approx(
            case["turnrl"]["step_s"] / case["trl"]["step_s"]
        )
    assert data["cases"]["single"]["turnrl"]["tool_calls_mean"] == 0
    assert (tmp / "runs" / "vs_trl" / "warmup-seed0-echo2" / "start_model").is_dir()
    # --smoke runs the real case's path on the random tiny model: templated, warmed up
    real = data["cases"]["real"]
    assert real["temperature"] == 0.7
    assert (
        Path(real["model"]) == tmp / "runs" / "vs_trl" / "real-warmup-start_model-2" / "start_model"
    )
    assert "<tool_call>" in (Path(real["model"]) / "chat_template.jinja").read_text()
    for case in data["cases"].values():
        assert len(case["load_before"]) == len(case["load_after"]) == 3
    assert "commit" in data
    assert data["cpu"]


def gpu(data: dict[str, Any], tmp: Path) -> None:
    assert [r["setup"] for r in data["real"]] == [
        "full, float32", "full, bf16-mixed, shared sampler", "full, bf16-mixed",
        "full, bf16-mixed, grad ckpt", "LoRA r16, bf16-mixed",
    ]  # fmt: skip
    for r in data["real"]:
        assert "error" not in r, r
        assert r["steps"] == 2
        assert r["step_s"] > 0
        assert r["tokens_per_s"] > 0
        assert r["startup_gap"] < 1e-3  # float32 on the CPU
    p = data["probe"]
    assert p["steps"] == 2
    assert [s for s, _ in p["curve"]] == [0, 2]


def distill(data: dict[str, Any], tmp: Path) -> None:
    teacher = data["teacher"]
    assert teacher["seed"] == 2
    assert Path(teacher["checkpoint"]).is_relative_to(tmp)
    assert (Path(teacher["checkpoint"]) / "model" / "config.json").is_file()
    assert data["target"] > 1  # --smoke: never reached, so every arm runs its steps
    rows = data["runs"]
    assert [(r["seed"], r["arm"]) for r in rows] == [
        (seed, arm) for seed in (0, 1) for arm in ("rl", "distill", "rl+distill")
    ]
    for r in rows:
        assert r["steps"] == 2
        curve_ok(r["curve"], 2)
        assert r["step_reaching_target"] is None
        assert (r["reverse_kl_first"] is None) == (r["arm"] == "rl")
        assert (tmp / "runs" / f"distill-student-seed{r['seed']}" / "start_model").is_dir()


def endpoint(data: dict[str, Any], tmp: Path) -> None:
    o = data["overhead"]
    for name in ("in_process", "endpoint", "endpoint_agent_processes"):
        assert o[name]["steps_timed"] >= 1
        assert o[name]["step_s"] > 0
        assert o[name]["errors"] == 0  # every agent episode reached its reward
    assert o["ratio_step"] == pytest.approx(o["endpoint"]["step_s"] / o["in_process"]["step_s"])
    own = o["endpoint_agent_processes"]["step_s"]
    assert o["ratio_step_agent_processes"] == pytest.approx(own / o["in_process"]["step_s"])
    r = data["learning"]
    assert next(s for s, _, _ in r["curve"]) == 0
    assert r["errors"] == 0


def scale(data: dict[str, Any], tmp: Path) -> None:
    (row,) = data["rows"]
    assert row["model"] == "tiny (64 x 2)"
    assert row["params"] > 0
    groups = {"1 rank", "2 ranks", "2 ranks, one unit"}
    assert set(row["step_s"]) == {"in-process, 1 thread", "in-process, 2 threads", *groups}
    assert set(row["gather_s"]) == set(row["start_s"]) == groups
    for times in (row["step_s"], row["gather_s"], row["start_s"]):
        assert all(s > 0 for s in times.values())
    whole, params = row["whole_parameter_bytes"], row["params"] * 4
    assert set(whole) == set(row["shard_bytes"]) == {"2 ranks", "2 ranks, one unit"}
    # one unit: every parameter whole while computing; layer units: less
    assert whole["2 ranks, one unit"] == params
    assert row["shard_bytes"]["2 ranks"] < whole["2 ranks"] < params
    a = data["async"]
    assert a["k0"]["timed_steps"] == a["k1"]["timed_steps"] == a["k2"]["timed_steps"] >= 1
    assert a["ratio"] == pytest.approx(a["k1"]["step_s"] / a["k0"]["step_s"])
    assert a["ratio_k2"] == pytest.approx(a["k2"]["step_s"] / a["k0"]["step_s"])
    assert a["k0"]["stale_by_k"] == 1.0  # synchronous: every trajectory 0 versions behind
    assert 0.0 <= a["k2"]["stale_by_k"] <= 1.0
    assert a["k0"]["token_lag"] == 0.0
    for key in ("k1p", "k2p"):  # partial rollouts: measured, tokens no staler than the bound
        assert a[key]["timed_steps"] == a["k0"]["timed_steps"]
        assert 0.0 <= a[key]["token_lag"] <= int(key[1])
        assert 0.0 <= a[key]["across_versions"] <= 1.0
    tail = data["tail"]
    for layout in ("", "_w1"):  # in process, and on one rollout worker
        sync = tail["k0" + layout]
        assert sync["batches_at_once"] == tail["k2p" + layout]["batches_at_once"] == 1.0
        assert tail["k2p_overlap" + layout]["batches_at_once"] >= 1.0
        for key in ("k2p" + layout, "k2p_overlap" + layout):
            assert tail[key]["ratio"] == pytest.approx(tail[key]["step_s"] / sync["step_s"])
            assert 0.0 <= tail[key]["token_lag"] <= 2.0
    w = data["workers"]
    layouts = ["in process, 1 thread", "in process, 2 threads", "1 worker", "2 workers"]
    assert all(w[k]["rollout_s"] > 0 and w[k]["episodes_per_s"] > 0 for k in layouts)
    assert w["in process, 1 thread"]["sync_s"] is None  # nothing to sync in process
    assert w["1 worker"]["sync_s"] > 0
    assert w["2 workers"]["sync_s"] > 0
    (sync,) = data["sync"]["rows"]
    assert (sync["hidden"], sync["layers"]) == (64, 2)
    timed = [f"{mode}, {n}" for mode in ("object_store", "broadcast") for n in (1, 2)]
    assert all(sync[key] > 0 for key in [*timed, "broadcast first, 1", "broadcast first, 2"])
    (ranks,) = data["ranks"]["rows"]
    assert (ranks["hidden"], ranks["layers"]) == (64, 2)
    ways = ["through the driver", "from the ranks"]
    assert all(ranks[f"{case}{way}"] > 0 for way in ways for case in ("", "LoRA, ", "k = 1, "))


def parity_2026(data: dict[str, Any], tmp: Path) -> None:
    assert data["smoke"] is True
    assert data["all_within_tolerance"] is True
    functions = {r["function"] for r in data["runs"]}
    assert {
        "icepop_weights",
        "cispo_policy_loss",
        "gmpo_policy_loss",
        "sapo_policy_loss",
    } <= functions
    assert all(r["cases"] == 1 and r["max_abs_diff"] <= data["tolerance"] for r in data["runs"])


CHECKS: dict[str, Check] = {
    "bf16_gradients": bf16_gradients,
    "copying": copying,
    "distill": distill,
    "endpoint": endpoint,
    "env_learning": env_learning,
    "envs": envs,
    "gpu": gpu,
    "learner": learner,
    "learning_proof": learning_proof,
    "parity_2026": parity_2026,
    "presets": presets,
    "real_model": real_model,
    "real_model_speed": real_model_speed,
    "reliability": reliability,
    "rollout": rollout,
    "scale": scale,
    "tools": tools,
    "vs_trl": vs_trl,
}
RUN_BY = {"vs_trl_trl_side": "vs_trl"}
"""Scripts another one runs (TRL's side, in TRL's virtualenv), checked by its smoke test."""
OWN_TEST = {"backends"}
"""Scripts that need vLLM: smoke-tested in .venv-vllm by their own file
(tests/test_benchmark_backends.py)."""
TIMEOUT_S = {"vs_trl": 600}
"""vs_trl makes TRL's virtualenv on first use (about a minute) unless `make setup-trl` has; the
others take seconds."""


def test_every_benchmark_script_has_a_smoke_test() -> None:
    assert scripts() == sorted([*CHECKS, *RUN_BY, *OWN_TEST])


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_smoke_run_writes_its_results(name: str, tmp_path: Path) -> None:
    if name == "envs" and not swe_tests_can_run():
        pytest.skip(f"{swe_runner.TEST_PYTHON} has no pytest (apt-get install python3-pytest)")
    before = files_under(BENCHMARKS / "results", BENCHMARKS / "runs")
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S.get(name, 300),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"--smoke: writing to {tmp_path}" in proc.stdout
    data = json.loads(out.with_suffix(".json").read_text())
    assert finite_numbers(data) == []
    table = out.with_suffix(".md").read_text()
    assert table.startswith("# ")
    assert re.search(r"^\|---", table, re.MULTILINE), "no table"
    CHECKS[name](data, tmp_path)
    assert files_under(BENCHMARKS / "results", BENCHMARKS / "runs") == before
