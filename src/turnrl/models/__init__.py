"""Models: the embedded tiny model (in each supported family), loading any model through
the transformers Auto path, and real models from GGUF files (named ones among them)."""

from turnrl.models.families import Family
from turnrl.models.gguf import (
    NAMED_MODELS,
    NamedModel,
    gguf_file,
    import_gguf,
    named_model_file,
    resolve_model,
)
from turnrl.models.loading import load_model, load_tokenizer, stop_token_ids
from turnrl.models.pretrain import made_up_word
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
    "NAMED_MODELS",
    "SPECIAL_TOKENS",
    "Family",
    "NamedModel",
    "TinyModelConfig",
    "build_tiny_model",
    "build_tokenizer",
    "default_corpus",
    "gguf_file",
    "import_gguf",
    "load_model",
    "load_tokenizer",
    "made_up_word",
    "named_model_file",
    "resolve_model",
    "stop_token_ids",
]
