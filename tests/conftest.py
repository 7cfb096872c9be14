"""Shared fixtures: one tiny model per test session, built locally in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from turnrl.envs import SecretLookup
from turnrl.models import TinyModelConfig, build_tiny_model, load_model, load_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    config = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=1024)
    return Path(build_tiny_model(out, config, extra_corpus=SecretLookup().corpus()))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def model(tiny_model_dir: Path) -> Any:
    return load_model(tiny_model_dir)
