"""Models: the embedded tiny model (in each supported family), loading any model through
the transformers Auto path, real models from GGUF files (named ones among them), and
``add_lora``, the adapters ``model.lora`` puts on a model (public so that a loop or a
benchmark of your own can train the policy a LoRA run trains)."""

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
from turnrl.models.lora import add_lora
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
    "add_lora",
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
