"""Loading a configuration: recipes (TOML files, each on an optional ``base``), ``--set
key=value`` overrides, and the coercion of raw values into the schema's types, checking
every key and type."""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from turnrl.errors import ConfigError
from turnrl.trainer.config.schema import Config, EnvConfig

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = "quickstart"


def load_config(
    recipe: str | None = None,
    overrides: Sequence[str] = (),
    settings: Mapping[str, Any] | None = None,
) -> Config:
    """Read a recipe (a name in recipes/ or a .toml path), apply ``key=value`` overrides
    (``--set``'s strings, each value read as JSON, else as a string), then ``settings``:
    dotted keys to typed values (``{"rollout.max_turns": 4}``), checked exactly as
    ``--set``'s."""
    data = read_recipe(recipe or DEFAULT_RECIPE)
    return apply_settings(data, [*map(parse_override, overrides), *(settings or {}).items()])


def parse_override(item: str) -> tuple[str, Any]:
    """``"rollout.max_turns=4"`` -> ``("rollout.max_turns", 4)``: the value is read as
    JSON, else ``true``/``false`` in any case, else kept as the string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {item!r}")
    return key.strip(), _parse_value(raw.strip())


def apply_settings(data: dict[str, Any], settings: Iterable[tuple[str, Any]]) -> Config:
    """The ``Config`` of raw settings ``data`` (a recipe's tables, in place) with each
    (dotted key, value) of ``settings`` set: every key and type checked, the sections
    validated. A section's value may be a table or a section (``RolloutConfig(...)``); it
    replaces the whole section."""
    parsed = []
    for key, value in settings:
        if not isinstance(key, str) or not all(key.split(".")):
            raise ConfigError(f"a setting is a dotted key such as 'rollout.max_turns', got {key!r}")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        parsed.append((key.split("."), value))
    # env.name first: a new environment drops the recipe's options for the old one, and the
    # options given beside it apply to the new one, in whatever order they were written.
    for keys, value in sorted(parsed, key=lambda kv: kv[0] != ["env", "name"]):
        if keys == ["env", "name"]:
            _switch_env(data, value)
        else:
            _assign(data, keys, value)
    config: Config = build(Config, data, "")
    return config


def _switch_env(data: dict[str, Any], name: Any) -> None:
    """Set the environment's name; its options belong to one environment, so another name
    starts from none (any preset combines with any environment)."""
    env = data.get("env")
    if not isinstance(env, dict) or env.get("name", EnvConfig.name) != name:
        data["env"] = {"name": name}


def read_recipe(recipe: str, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe's settings. A recipe may name another as ``base = "name"``: the base is read
    first and the recipe's own keys override it, section by section (presets are a few
    algorithm knobs on top of a probe recipe)."""
    path = Path(recipe)
    if path.suffix != ".toml":
        path = RECIPES_DIR / f"{recipe}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES_DIR.glob("*.toml")) if RECIPES_DIR.is_dir() else []
        raise ConfigError(f"no recipe {recipe!r} (looked for {path}); known recipes: {known}")
    if path.resolve() in _seen:
        chain = " -> ".join(p.stem for p in (*_seen, path.resolve()))
        raise ConfigError(f"recipe bases form a cycle: {chain}")
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be a recipe name, got {base!r}")
    merged = read_recipe(base, (*_seen, path.resolve()))
    _merge(merged, data)
    return merged


def _merge(into: dict[str, Any], data: dict[str, Any]) -> None:
    for key, value in data.items():
        if key == "env" and isinstance(value, dict) and "name" in value:
            _switch_env(into, value["name"])  # the base's options were for its environment
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, deep nesting
        low = raw.lower()
        return {"true": True, "false": False}.get(low, raw)


def _assign(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {k} is not a section")
    node[keys[-1]] = value


def build(cls: type[Any], data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from nested dicts, checking keys and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a table of settings, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    if cls is EnvConfig:  # environment options are free-form here, checked by the env
        if not isinstance(data.get("options", {}), dict):
            raise ConfigError(f"{where}.options must be a table, got {data['options']!r}")
        options = dict(data.get("options", {}))
        options.update({k: v for k, v in data.items() if k not in ("name", "options")})
        data = {"name": data.get("name", EnvConfig.name), "options": options}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            raise ConfigError(f"unknown config key {path!r}{_nearest(key, fields, hints, where)}")
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def _nearest(key: str, fields: dict[str, Any], hints: dict[str, Any], where: str) -> str:
    """A hint for an unknown ``key`` of section ``where``, as a whole dotted key: the
    setting of a sub-section of that very name (``model.hidden_size`` is
    ``model.tiny.hidden_size``), else the nearest setting of the section, a key of a
    sub-section included (``kl_coef`` is near ``kl.coef``), else the section's keys."""
    near = {name: name for name in fields}
    inside: dict[str, list[str]] = {}  # a sub-section's setting name -> its dotted keys
    for name in fields:
        if isinstance(hints[name], type) and dataclasses.is_dataclass(hints[name]):
            for f in dataclasses.fields(hints[name]):
                near[f"{name}_{f.name}"] = f"{name}.{f.name}"
                inside.setdefault(f.name, []).append(f"{name}.{f.name}")
    if len(inside.get(key, [])) == 1:
        guess = inside[key][0]
    else:
        close = difflib.get_close_matches(key, list(near), n=1)
        if not close:
            return f"; known: {sorted(fields)}"
        guess = near[close[0]]
    dotted = f"{where}.{guess}" if where else guess
    return f"; did you mean {dotted!r}?"


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path} must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(arg, value, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: {value!r} does not fit {tp}")
    if origin is tuple:  # tuple[str, ...]: a list of names
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path} must be a list of strings, got {value!r}")
        return tuple(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a table, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is type(None):
        if value is None:
            return None
    else:
        return value
    raise ConfigError(f"{path} must be {getattr(tp, '__name__', tp)}, got {value!r}")
