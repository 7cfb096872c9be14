"""The training configuration: frozen dataclasses, a docstring per field, validated once.

A recipe (a TOML file in recipes/) gives values by section; ``--set section.key=value``
overrides them. Unknown keys and values of the wrong type are errors that name the key and
say what was expected. Environment options are checked by the environment itself.

Three modules: ``schema`` (the dataclasses and their help), ``loading`` (recipes, TOML,
overrides and coercion) and ``resolution`` (the ``auto`` choices, settings without effect);
``help`` is the settings' one-line help, generated from the schema's docstrings.
"""

from turnrl.trainer.config.loading import (
    DEFAULT_RECIPE,
    RECIPES_DIR,
    apply_settings,
    build,
    load_config,
    parse_override,
    read_recipe,
)
from turnrl.trainer.config.resolution import (
    CAPPED,
    STARTUP_TOLERANCE,
    inert_settings,
    resolved,
)
from turnrl.trainer.config.schema import (
    BANDS,
    AlgorithmConfig,
    ClipConfig,
    ClusterConfig,
    Config,
    CriticConfig,
    EnvConfig,
    EvalConfig,
    FilterConfig,
    GAEConfig,
    GiGPOConfig,
    KLConfig,
    LogConfig,
    LoRAConfig,
    MicroBatchConfig,
    ModelConfig,
    MonitorConfig,
    OffPolicyConfig,
    OverlongConfig,
    RolloutConfig,
    SAPOConfig,
    TeacherConfig,
    TinyModelSettings,
    WarmupConfig,
    describe,
    field_help,
)

__all__ = [
    "BANDS",
    "CAPPED",
    "DEFAULT_RECIPE",
    "RECIPES_DIR",
    "STARTUP_TOLERANCE",
    "AlgorithmConfig",
    "ClipConfig",
    "ClusterConfig",
    "Config",
    "CriticConfig",
    "EnvConfig",
    "EvalConfig",
    "FilterConfig",
    "GAEConfig",
    "GiGPOConfig",
    "KLConfig",
    "LoRAConfig",
    "LogConfig",
    "MicroBatchConfig",
    "ModelConfig",
    "MonitorConfig",
    "OffPolicyConfig",
    "OverlongConfig",
    "RolloutConfig",
    "SAPOConfig",
    "TeacherConfig",
    "TinyModelSettings",
    "WarmupConfig",
    "apply_settings",
    "build",
    "describe",
    "field_help",
    "inert_settings",
    "load_config",
    "parse_override",
    "read_recipe",
    "resolved",
]
