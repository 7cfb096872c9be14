"""Models: the embedded tiny model (in each supported family) and loading any model through
the transformers Auto path."""

from turnrl.models.families import Family
from turnrl.models.loading import load_model, load_tokenizer, stop_token_ids
from turnrl.models.tiny import (
    CHAT_TEMPLATE,
    FAMILIES,
    SPECIAL_TOKENS,
    TinyModelConfig,
    build_tiny_model,
    build_tokenizer,
    default_corpus,
)

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "SPECIAL_TOKENS",
    "Family",
    "TinyModelConfig",
    "build_tiny_model",
    "build_tokenizer",
    "default_corpus",
    "load_model",
    "load_tokenizer",
    "stop_token_ids",
]
