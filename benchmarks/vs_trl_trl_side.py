"""TRL's side of benchmarks/vs_trl.py: GRPO steps with TRL's GRPOTrainer, timed.

Runs in TRL's own virtualenv (it never imports turnrl). ``benchmarks/vs_trl.py`` writes a
spec (model directory, tasks, batch shape, limits) and runs this script; it prints one
JSON line: per-step wall time, generation time, completion tokens, tool calls and peak
memory.

    .venv-trl/bin/python benchmarks/vs_trl_trl_side.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_template


class Lookup:
    """The secret-lookup tool with the same name, signature and docstring as turnrl's."""

    def reset(self, **row: Any) -> None:
        self.table = json.loads(row["table"])

    def lookup(self, key: str) -> str:
        """Look up a key.

        Args:
            key: The key.
        """
        if key not in self.table:
            raise LookupError(f"no key {key!r} in the table")
        return str(self.table[key])


def answer_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1 when the final assistant message is exactly the asked key's value."""
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        last = completion[-1]["content"] if isinstance(completion, list) else completion
        out.append(float(str(last).strip() == gold))
    return out


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tools = spec["tools"]  # multi and real: the lookup tool, several turns
    with open(spec["tasks"]) as f:
        rows = [json.loads(line) for line in f]
    data = Dataset.from_list(
        [
            {"prompt": r["prompt"], "answer": r["answer"], "table": json.dumps(r["table"])}
            for r in rows
        ]
    )
    if tools:
        # The tiny model (and the real case's SmolLM2, given the tiny model's ChatML tool
        # template) writes Qwen's <tool_call>{json}</tool_call>; TRL parses it with its
        # Qwen response template (it cannot recognise the template as any it knows).
        tokenizer.response_template = qwen3_template
    steps = spec["warmup_steps"] + spec["steps"]
    batch = spec["prompts_per_step"] * spec["group_size"]
    args = GRPOConfig(
        output_dir=spec["out_dir"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=spec["group_size"],
        max_completion_length=spec["max_completion_length"],
        max_tool_calling_iterations=spec["max_tool_calls"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        learning_rate=spec["lr"] or 1e-5,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
        shuffle_dataset=False,
        seed=spec["seed"],
        gradient_checkpointing=False,
        use_transformers_continuous_batching=spec.get("continuous_batching", False),
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=answer_reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        environment_factory=Lookup if tools else None,
        callbacks=[timer],
    )
    gen_times: list[float] = []
    generate = trainer._generate

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        gen_times.append(time.perf_counter() - t0)
        return out

    trainer._generate = timed_generate  # type: ignore[method-assign]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    skip = spec["warmup_steps"]
    result = {
        "side": "trl",
        "step_s": timer.times[skip:],
        "generate_s": gen_times[skip:],
        "completion_tokens_mean": [h["completions/mean_length"] for h in logs][skip:],
        "tool_calls_mean": [h.get("tools/call_frequency", 0.0) for h in logs][skip:],
        "reward_mean": [h.get("reward", 0.0) for h in logs][skip:],
        "batch": batch,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
