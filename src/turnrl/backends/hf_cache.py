"""How turnrl hands a key/value cache to a transformers model and reads it back.

transformers 5.24 renamed the forward argument and the output field ``past_key_values`` to
``cache`` (the old name still works there, with a deprecation warning, until 5.40). turnrl
supports both sides of the rename, because vLLM's CPU build pins an older transformers:
the name is read off the model's own ``forward`` signature, once per model class, so each
architecture is asked in the spelling it declares.
"""

from __future__ import annotations

import inspect
from typing import Any

_ARGUMENT: dict[type, str] = {}
"""Each model class's name for the cache argument, read once."""


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that passes ``cache`` to ``model``'s forward: ``cache`` where the
    class's ``forward`` declares it (transformers >= 5.24), else ``past_key_values``."""
    model_class = type(model)
    name = _ARGUMENT.get(model_class)
    if name is None:
        parameters = inspect.signature(model_class.forward).parameters
        name = _ARGUMENT[model_class] = "cache" if "cache" in parameters else "past_key_values"
    return {name: cache}


def returned_cache(output: Any) -> Any:
    """The key/value cache a forward with ``use_cache=True`` returned."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
