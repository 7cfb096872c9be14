"""Evaluation of a checkpoint or an OpenAI-compatible endpoint on an environment."""

from turnrl.evaluation.runner import EvalConfig, evaluate, summarize, summary_lines

__all__ = ["EvalConfig", "evaluate", "summarize", "summary_lines"]
