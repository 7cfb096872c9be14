"""The ``turnrl`` command line: train, evaluate, serve, build a tiny model, list and check
environments, report.

Errors turnrl raises on purpose (bad config, missing model, ...) print one clear line and
exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from turnrl.errors import ConfigError, TurnrlError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        result: int = args.run(args)
        return result
    except TurnrlError as exc:
        print(f"turnrl: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnrl", description=__doc__)
    sub = parser.add_subparsers(dest="command")

    train = sub.add_parser("train", help="train a policy with RL (default: the quick-start)")
    _recipe_arguments(train)
    train.add_argument("--out", type=Path, default=None, help="run directory (runs/<name>)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=_train)
    train.epilog = "Every setting, with its help: turnrl config show [RECIPE] [--set ...]"

    config = sub.add_parser("config", help="show a recipe's resolved settings with their help")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved configuration as TOML")
    _recipe_arguments(show)
    show.set_defaults(run=_config_show)

    init = sub.add_parser("init-model", help="build a tiny model and tokenizer locally")
    init.add_argument("out", type=Path)
    init.add_argument(
        "--arch", choices=["qwen2", "llama", "qwen3", "llama3", "mistral"], default="qwen2"
    )
    init.add_argument("--hidden-size", type=int, default=128)
    init.add_argument("--num-layers", type=int, default=4)
    init.add_argument("--num-heads", type=int, default=4)
    init.add_argument("--vocab-size", type=int, default=2048)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument(
        "--echo-steps", type=int, default=2500,
        help="generic 'repeat what was said' tuning steps (in-context copying); 0: random",
    )  # fmt: skip
    init.add_argument(
        "--env", default="secret_lookup", help="add this env's text to the tokenizer corpus"
    )
    init.add_argument("--overwrite", action="store_true")
    init.set_defaults(run=_init_model)

    models = sub.add_parser("models", help="the named real models; import a GGUF file")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_sub.add_parser(
        "list", help="the models model.path may name, and whether each is installed"
    ).set_defaults(run=_models_list)
    imp = models_sub.add_parser(
        "import",
        help="de-quantize a GGUF file into a float32 checkpoint directory (what model.path "
        "does on first use of a GGUF file, into turnrl's cache)",
    )
    imp.add_argument(
        "source", help="a .gguf file, a directory holding one, or a named model (models list)"
    )
    imp.add_argument("out", type=Path, help="the checkpoint directory to write")
    imp.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    imp.set_defaults(run=_models_import)

    envs = sub.add_parser("envs", help="list registered environments, or check one")
    envs_sub = envs.add_subparsers(dest="envs_command", required=True)
    envs_sub.add_parser("list", help="list registered environments").set_defaults(run=_envs)
    check = envs_sub.add_parser(
        "check",
        help="check an environment's contract and red-team its verifier with reward-hacking "
        "probes; exit 1 if a check fails (a probe that scores is a warning, one that "
        "succeeds a failure)",
    )
    check.add_argument(
        "name", help="a registered environment (see `turnrl envs list`) or package.module:factory"
    )
    check.add_argument("--tasks", type=int, default=20, help="seeded test tasks to play")
    check.add_argument("--seed", type=int, default=0, help="seed of the episodes")
    check.add_argument(
        "--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
        help="an environment option, e.g. --set slip_prob=0.2 (repeatable; JSON values)",
    )  # fmt: skip
    check.set_defaults(run=_envs_check)

    ev = sub.add_parser(
        "eval", help="evaluate a checkpoint or an OpenAI-compatible endpoint on an environment"
    )
    ev.add_argument("--env", required=True, help="a registered environment")
    source = ev.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a local model directory (torch backend)")
    source.add_argument(
        "--endpoint", help="an OpenAI-compatible base URL, e.g. http://host:8000/v1"
    )
    ev.add_argument("--model-name", help="the endpoint's model id (default: its first model)")
    ev.add_argument("--n", type=int, default=64, help="test tasks")
    ev.add_argument("--k", type=int, default=1, help="samples per task (pass@k)")
    ev.add_argument("--split", default="test")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--max-turns", type=int, default=4)
    ev.add_argument("--max-tokens", type=int, default=64, help="tokens per turn")
    ev.add_argument("--max-episode-tokens", type=int, default=256)
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--top-p", type=float, default=1.0)
    ev.add_argument("--concurrency", type=int, default=8, help="episodes in flight (endpoint)")
    ev.add_argument("--out", type=Path, default=None, help="output directory (resumable)")
    ev.add_argument(
        "--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
        help="an environment option (repeatable; JSON values)",
    )  # fmt: skip
    ev.add_argument("--no-progress", action="store_true")
    ev.set_defaults(run=_eval)

    srv = sub.add_parser("serve", help="serve a local model over an OpenAI-compatible API")
    srv.add_argument("model", type=Path)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000, help="0: any free port")
    srv.add_argument("--name", default=None, help="the model id to report")
    srv.set_defaults(run=_serve)

    export = sub.add_parser(
        "export", help="write a run's policy as one merged save_pretrained model"
    )
    export.add_argument("run_dir", type=Path, help="a run directory or a checkpoint directory")
    export.add_argument("out", type=Path, help="the model directory to write")
    export.add_argument(
        "--step", type=int, default=None, help="a checkpoint step (default: latest)"
    )
    export.set_defaults(run=_export)

    doctor = sub.add_parser("doctor", help="versions, devices, sandbox, extras; a self-check")
    doctor.set_defaults(run=_doctor)

    report = sub.add_parser("report", help="(re)write report.html of a run directory")
    report.add_argument("run_dir", type=Path)
    report.set_defaults(run=_report)
    return parser


def _recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """A recipe and its ``--set`` overrides (``train`` and ``config show`` read the same)."""
    parser.add_argument("recipe", nargs="?", default=None, help="recipe name or .toml path")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set rollout.group_size=8 (repeatable)",
    )  # fmt: skip


def _config_show(args: argparse.Namespace) -> int:
    from turnrl.trainer.config import describe, inert_settings, load_config

    config = load_config(args.recipe, args.overrides)
    print("\n".join(describe(config)))
    for message in inert_settings(config):
        print(f"# warning: {message}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from turnrl.api import train
    from turnrl.report import read_metrics, write_report
    from turnrl.trainer.config import load_config

    config = load_config(args.recipe, args.overrides)
    run_dir = args.out or Path("runs") / config.name
    print(f"turnrl: run directory {run_dir}")
    t0 = time.perf_counter()
    result = train(  # in process, or with cluster.learner_ranks >= 1 a learner group
        config, out=run_dir, resume=args.resume, progress=not args.no_progress,
        on_row=_report_every(run_dir, REPORT_EVERY_S),
    )  # fmt: skip
    report = write_report(run_dir)
    # the whole run's, a resumed run's steps before the resume included
    rows = [r for r in read_metrics(run_dir) if "eval/success_mean" in r]
    if rows:
        first, last = rows[0], rows[-1]
        print(
            f"turnrl: held-out success {first['eval/success_mean']:.2f} (step {first['step']}) "
            f"-> {last['eval/success_mean']:.2f} (step {last['step']})"
        )
    print(f"turnrl: done in {time.perf_counter() - t0:.0f} s")
    print(f"turnrl: metrics      {run_dir / 'metrics.jsonl'}")
    print(f"turnrl: trajectories {run_dir / 'trajectories.jsonl'}")
    print(f"turnrl: curves       {run_dir / 'learning_curve.png'}")
    print(f"turnrl: report       {report}")
    return 130 if result.interrupted else 0  # stopped by Ctrl-C: the shell's code for it


REPORT_EVERY_S = 60.0
"""``turnrl train`` rewrites report.html at most this often while the run goes on."""


def _report_every(run_dir: Path, seconds: float) -> Any:
    """An ``on_row`` callback that rewrites the run's report.html every ``seconds``, so a
    running (or killed) run has a current report; a failure to write it is printed and
    training goes on."""
    from turnrl.report import write_report

    last = [time.monotonic()]

    def on_row(row: dict[str, Any]) -> None:
        if time.monotonic() - last[0] < seconds:
            return
        last[0] = time.monotonic()
        try:
            write_report(run_dir)
        except Exception as exc:  # the report must never stop the run
            print(f"turnrl: warning: report.html not updated: {exc}", file=sys.stderr)

    return on_row


def _init_model(args: argparse.Namespace) -> int:
    from turnrl.envs import make_env_family
    from turnrl.models import TinyModelConfig, build_tiny_model

    config = TinyModelConfig(
        arch=args.arch, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, vocab_size=args.vocab_size, seed=args.seed,
        echo_steps=args.echo_steps,
    )  # fmt: skip
    corpus = make_env_family(args.env).corpus() if args.env else []
    path = build_tiny_model(args.out, config, extra_corpus=corpus, overwrite=args.overwrite)
    print(f"turnrl: tiny model written to {path}")
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from turnrl.models import NAMED_MODELS, named_model_file

    for name, model in NAMED_MODELS.items():
        try:
            where = str(named_model_file(name))
        except ConfigError:
            where = f"not installed: {model.install}"
        print(f"{name:16s} {model.about}\n{'':16s} {where}")
    return 0


def _models_import(args: argparse.Namespace) -> int:
    from turnrl.models import NAMED_MODELS, gguf_file, import_gguf, named_model_file

    source = Path(args.source).expanduser()
    if args.source in NAMED_MODELS:
        file = named_model_file(args.source)
    elif (found := gguf_file(source)) is not None:
        file = found
    else:
        raise ConfigError(
            f"{args.source} is neither a .gguf file, a directory holding one, nor a named "
            f"model ({', '.join(NAMED_MODELS)})"
        )
    t0 = time.perf_counter()
    out = import_gguf(file, args.out, overwrite=args.overwrite)
    print(f"turnrl: {file.name} imported to {out} in {time.perf_counter() - t0:.0f} s")
    return 0


def _envs(args: argparse.Namespace) -> int:
    from turnrl.envs import ENVIRONMENTS

    for name, cls in sorted(ENVIRONMENTS.items()):
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        print(f"{name:20s} {doc}")
    return 0


def _envs_check(args: argparse.Namespace) -> int:
    from turnrl.envs import check_env, make_env_family
    from turnrl.envs.policy import HasCard

    spec = make_env_family(args.name, **_env_options(args.options))
    if isinstance(spec, HasCard):
        print("\n".join(spec.card.lines()), end="\n\n")
    report = check_env(spec, num_tasks=args.tasks, seed=args.seed)
    print(report.table())
    warnings = sum(not p.failed for p in report.findings)
    verdict = "passed" if report.ok else "FAILED"
    if warnings:
        verdict += f" ({warnings} probe warning{'s' * (warnings > 1)})"
    print(f"turnrl: envs check {args.name}: {verdict}")
    return 0 if report.ok else 1


def _env_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as options; a value is read as JSON, else kept as a string."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _eval(args: argparse.Namespace) -> int:
    from turnrl.evaluation import EvalConfig, evaluate, summary_lines

    config = EvalConfig(
        env=args.env, env_options=_env_options(args.options), n=args.n, k=args.k,
        split=args.split, seed=args.seed, max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens, max_episode_tokens=args.max_episode_tokens,
        temperature=args.temperature, top_p=args.top_p, concurrency=args.concurrency,
    )  # fmt: skip
    out = args.out or Path("runs") / f"eval-{args.env}"
    print(f"turnrl: evaluation directory {out}")
    summary = evaluate(
        config, out, model_path=args.model, endpoint=args.endpoint,
        model_name=args.model_name, progress=not args.no_progress,
    )  # fmt: skip
    print("\n".join(summary_lines(summary)))
    print(f"turnrl: episodes {out / 'episodes.jsonl'}; summary {out / 'summary.json'}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from turnrl.serving import serve

    serve(args.model, host=args.host, port=args.port, name=args.name)
    return 0


def _export(args: argparse.Namespace) -> int:
    from turnrl.trainer.checkpoint import export_model

    exported = export_model(args.run_dir, args.out, step=args.step)
    print(f"turnrl: wrote {args.out} (from {exported}); load it with "
          "AutoModelForCausalLM.from_pretrained or serve it with vLLM")  # fmt: skip
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from turnrl.doctor import run

    return 0 if run() else 1


def _report(args: argparse.Namespace) -> int:
    from turnrl.report import write_report

    print(write_report(args.run_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
