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
import warnings
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from turnrl.errors import ConfigError, ConfigRenamed
from turnrl.trainer.config.schema import Config, EnvConfig

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = "quickstart"


RENAMED = {
    "eps_low": "clip.low", "eps_high": "clip.high", "dual_clip": "clip.dual",
    "kl_coef": "kl.coef", "kl_estimator": "kl.estimator", "kl_placement": "kl.placement",
    "dynamic_sampling": "filter.dynamic_sampling", "max_sample_rounds": "filter.max_rounds",
    "variance_filter_keep": "filter.variance_keep",
    "overlong_cache_tokens": "overlong.penalty_tokens", "overlong_filter": "overlong.filter",
    "tis_cap": "off_policy.cap", "critic_lr": "critic.lr", "critic_epochs": "critic.epochs",
    "value_clip": "critic.value_clip", "gae_gamma": "gae.gamma", "gae_lambda": "gae.lam",
    "gae_level": "gae.level", "gae_turn_gamma": "gae.turn_gamma",
    "whiten_advantages": "gae.whiten", "gigpo_gamma": "gigpo.gamma",
    "gigpo_omega": "gigpo.omega", "micro_batch_size": "micro_batch.size",
    "micro_batch_tokens": "micro_batch.tokens", "sequence_layout": "micro_batch.layout",
}  # fmt: skip
"""Flat ``algorithm`` keys of turnrl before 2026-11-26 -> their nested key (still read)."""
RENAMED_IF_STRING = {"off_policy": "off_policy.correction", "critic": "critic.placement"}
"""Keys that were strings and are now sections: a string goes to this key."""


def load_config(recipe: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a recipe (a name in recipes/ or a .toml path), apply ``key=value`` overrides."""
    renamed: list[str] = []
    data = read_recipe(recipe or DEFAULT_RECIPE, renamed=renamed)
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        keys, value = key.strip().split("."), _parse_value(raw.strip())
        parsed.append((_renamed_key(keys, value, renamed), value))
    # env.name first: a new environment drops the recipe's options for the old one, and the
    # options given beside it apply to the new one, in whatever order they were written.
    for keys, value in sorted(parsed, key=lambda kv: kv[0] != ["env", "name"]):
        if keys == ["env", "name"]:
            _switch_env(data, value)
        else:
            _assign(data, keys, value)
    if renamed:
        warnings.warn(
            "renamed settings (the old names still work): " + "; ".join(dict.fromkeys(renamed)),
            ConfigRenamed,
            stacklevel=2,
        )
    config: Config = build(Config, data, "")
    return config


def upgrade(data: dict[str, Any], renamed: list[str] | None = None) -> dict[str, Any]:
    """Move flat ``algorithm`` keys of older recipes (``kl_coef``) to their sections
    (``kl.coef``) in a raw settings table, in place; each move is added to ``renamed``."""
    algo = data.get("algorithm")
    if not isinstance(algo, dict):
        return data
    for old in list(algo):
        new = _renamed_key(["algorithm", old], algo[old], renamed)
        if new[1:] == [old]:
            continue
        value = algo.pop(old)
        section = algo.setdefault(new[1], {})
        if not isinstance(section, dict):
            raise ConfigError(f"algorithm.{new[1]} must be a table of settings, got {section!r}")
        if new[2] in section:
            raise ConfigError(
                f"both algorithm.{old} (its old name) and algorithm.{'.'.join(new[1:])} are "
                f"given: keep algorithm.{'.'.join(new[1:])}"
            )
        section[new[2]] = value
    return data


def _renamed_key(keys: list[str], value: Any, renamed: list[str] | None) -> list[str]:
    """``keys`` under its current name (``algorithm.kl_coef`` -> ``algorithm.kl.coef``)."""
    if len(keys) != 2 or keys[0] != "algorithm":
        return keys
    new = RENAMED.get(keys[1])
    if new is None and isinstance(value, str):
        new = RENAMED_IF_STRING.get(keys[1])
    if new is None:
        return keys
    if renamed is not None:
        renamed.append(f"algorithm.{keys[1]} is algorithm.{new}")
    return ["algorithm", *new.split(".")]


def _switch_env(data: dict[str, Any], name: Any) -> None:
    """Set the environment's name; its options belong to one environment, so another name
    starts from none (any preset combines with any environment)."""
    env = data.get("env")
    if not isinstance(env, dict) or env.get("name", EnvConfig.name) != name:
        data["env"] = {"name": name}


def read_recipe(
    recipe: str, _seen: tuple[Path, ...] = (), renamed: list[str] | None = None
) -> dict[str, Any]:
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
    upgrade(data, renamed)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be a recipe name, got {base!r}")
    merged = read_recipe(base, (*_seen, path.resolve()), renamed)
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
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {sorted(fields)}"
            raise ConfigError(f"unknown config key {path!r}{hint}")
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


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
