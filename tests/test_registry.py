"""Environments by name or by import path ("package.module:factory")."""

from __future__ import annotations

import pytest

from turnrl.envs import SecretLookup, make_env_family
from turnrl.errors import ConfigError


def small_probe(keys: int = 2) -> SecretLookup:
    """A function factory, as a user would write one."""
    return SecretLookup(num_keys=keys, key_pool=keys)


def not_an_environment() -> str:
    return "hello"


def test_a_class_by_import_path_takes_its_fields_as_options() -> None:
    spec = make_env_family("turnrl.envs.secret_lookup:SecretLookup", num_keys=2, key_pool=2)
    assert spec == SecretLookup(num_keys=2, key_pool=2)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['colour'\]"):
        make_env_family("turnrl.envs.secret_lookup:SecretLookup", colour="red")


def test_a_function_by_import_path_is_called_with_the_options() -> None:
    spec = make_env_family(f"{__name__}:small_probe", keys=3)
    assert spec == SecretLookup(num_keys=3, key_pool=3)
    with pytest.raises(ConfigError, match="does not take options"):
        make_env_family(f"{__name__}:small_probe", colour="red")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
        ("turnrl.envs:NoSuchThing", "has no 'NoSuchThing'"),
        ("turnrl.envs:ENVIRONMENTS", "not a class or a function"),
        (
            f"{__name__}:test_a_function_by_import_path_is_called_with_the_options",
            "no task or make_env",
        ),
        ("no_such_env", "known: bandit"),
    ],
)
def test_bad_names_are_clear_errors(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_env_family(name)
