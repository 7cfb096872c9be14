"""The key/value cache argument across transformers' ``past_key_values`` -> ``cache`` rename."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import torch
import transformers

from turnrl.backends.hf_cache import cache_kwargs, returned_cache


class _OldSpelling:
    def forward(self, input_ids: Any = None, past_key_values: Any = None) -> None: ...


class _NewSpelling:
    def forward(self, input_ids: Any = None, cache: Any = None) -> None: ...


def test_each_model_class_is_asked_in_the_spelling_it_declares() -> None:
    marker = object()
    assert cache_kwargs(_OldSpelling(), marker) == {"past_key_values": marker}
    assert cache_kwargs(_NewSpelling(), marker) == {"cache": marker}


def test_the_returned_cache_is_read_under_either_name() -> None:
    marker = object()
    assert returned_cache(SimpleNamespace(cache=marker)) is marker
    assert returned_cache(SimpleNamespace(past_key_values=marker)) is marker


def test_a_real_model_continues_from_its_cache_without_deprecation_warnings() -> None:
    """Prefill then one cached decode step equal the full forward, and the installed
    transformers warns about nothing on the way (5.24 deprecated the old name)."""
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits[:, -1]
            head = model(input_ids=ids[:, :-1], use_cache=True)
            step = model(
                input_ids=ids[:, -1:], use_cache=True, **cache_kwargs(model, returned_cache(head))
            )
    torch.testing.assert_close(step.logits[:, -1], full, rtol=1e-5, atol=1e-5)
