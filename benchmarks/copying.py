"""How well the tiny model copies from its context, by echo-tuning budget and word source.

The tiny model gets its in-context copying from echo tuning (``turnrl.models.pretrain``).
Tasks whose answers are names the model has never seen (``search_qa`` builds a fresh
world per task; its names are cut into several BPE pieces) need copying of unseen token
sequences, not only of words the tokenizer has one token for. This measures, greedily:

- ``made-up``: "Say W." for made-up words from the echo generator's own distribution
  (a seed the tuning never used);
- ``names``: "Say N." for person and city names of search_qa worlds the model never saw
  (the ``world`` of search_qa families whose seeds no recipe uses; until issue 55 they came
  from the world builder itself with seeds "copying/i": other worlds alike, other names);
- ``names in a sentence``: "The word is N. What is the word?" for the same names.

    python benchmarks/copying.py                   # builds the four models below (~25 min)
    python benchmarks/copying.py --models DIR ...  # measures models already built
    python benchmarks/copying.py --smoke           # one tiny model, 3 words (seconds)

Each model is built like the ``search_qa`` recipe's (its corpus, 64 wide, 2 layers, seed 0)
with ``echo_steps`` x ``echo_novel`` from ``CONFIGS``, into benchmarks/runs. Writes
benchmarks/results/copying.json and .md (``--out``, ``--runs-dir``; ``--smoke``: a temporary
directory).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from outputs import parse_args
from training_runs import write_results
from turnrl import load_config, make_env_family
from turnrl.models import build_tiny_model, made_up_word
from turnrl.trainer import tiny_model_config

ROOT = Path(__file__).resolve().parent
CONFIGS = [(2500, 0.0), (2500, 0.5), (6000, 0.5), (6000, 0.8)]  # (echo_steps, echo_novel)
NUM_WORDS = 60
SMOKE_MODEL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2"]


def build(out: Path, echo_steps: int, echo_novel: float, extra: list[str] | None = None) -> Path:
    """The search_qa recipe's tiny model with the given echo tuning (and ``extra``
    overrides)."""
    recipe = load_config("search_qa", [f"model.tiny.echo_steps={echo_steps}",
                                       f"model.tiny.echo_novel={echo_novel}",
                                       *(extra or [])])  # fmt: skip
    spec = make_env_family(recipe.env.name, **recipe.env.options)
    return build_tiny_model(
        out, tiny_model_config(recipe), extra_corpus=spec.corpus(), overwrite=True
    )


def copy_rate(model: Any, tokenizer: Any, words: list[str], template: str) -> float:
    """Share of ``words`` the model's greedy reply to ``template`` repeats exactly."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hits = 0
    for word in words:
        chat = [{"role": "user", "content": template.format(w=word)}]
        ids = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=end)
        hits += tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip() == word
    return hits / len(words)


UNSEEN_SEED = 1_000_000
"""The first search_qa seed of the worlds names are drawn from: no recipe's (theirs are
small), so the model never saw these worlds."""


def unseen_names(count: int) -> list[str]:
    """Person and city names of small search_qa worlds no recipe builds (the ``world`` of
    the family with seed ``UNSEEN_SEED + i``)."""
    names: list[str] = []
    i = 0
    while len(names) < count:
        family: Any = make_env_family(
            "search_qa", seed=UNSEEN_SEED + i, countries=2, cities=4, companies=2, people=6
        )
        names += [n for kind in ("person", "city") for n in family.world.names(kind)[:1]]
        i += 1
    return names[:count]


def measure(path: Path, num_words: int) -> dict[str, Any]:
    info = json.loads((path / "turnrl_model.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    rng = random.Random("copying-benchmark")
    made_up = [made_up_word(rng) for _ in range(num_words)]
    names = unseen_names(num_words)
    pieces = sum(len(tokenizer.encode(n, add_special_tokens=False)) for n in names) / len(names)
    return {
        "model": str(path),
        "echo_steps": info["config"]["echo_steps"],
        "echo_novel": info["config"].get("echo_novel", 0.0),
        "echo_loss_last": info["echo_loss_last"],
        "made_up": copy_rate(model, tokenizer, made_up, "Say {w}."),
        "names": copy_rate(model, tokenizer, names, "Say {w}."),
        "names_in_sentence": copy_rate(
            model, tokenizer, names, "The word is {w}. What is the word?"
        ),
        "tokens_per_name": round(pieces, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", type=Path, help="measure these model dirs")
    parser.add_argument("--words", type=int, default=NUM_WORDS, help="words per measure")
    args = parse_args(parser, "copying", {"words": 3}, runs=True)
    configs, extra = ([(4, 0.5)], SMOKE_MODEL) if args.smoke else (CONFIGS, [])
    paths = args.models
    if not paths:
        paths = [
            build(args.runs_dir / f"copying-echo{s}-novel{n}", s, n, extra) for s, n in configs
        ]
    results = sorted(
        (measure(p, args.words) for p in paths), key=lambda r: (r["echo_steps"], r["echo_novel"])
    )
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "num_words": args.words,
    }
    lines = [
        f"# In-context copying of the tiny model ({meta['date']}, {meta['machine']})",
        "",
        f"Greedy exact repeats of {args.words} words each; search_qa-style names average "
        f"{results[0]['tokens_per_name']} tokens.",
        "",
        "| echo steps | made-up share | echo loss (last) | made-up words | names | "
        "names in a sentence |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['echo_steps']} | {r['echo_novel']} | {r['echo_loss_last']:.3f} | "
        f"{r['made_up']:.2f} | {r['names']:.2f} | {r['names_in_sentence']:.2f} |"
        for r in results
    ]
    write_results(args.out, meta, results, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
