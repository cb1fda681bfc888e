"""The model repository template ships inside the package (paths.model_repository_template): its
model.py files only import a class of paged_llm.triton_model, and the wheel declares every file."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch

from paged_llm.paths import model_repository_template, repo_root

MAX_SHIM_LINES = 30


def test_every_model_py_is_a_shim_importing_the_package() -> None:
    model_files = sorted(model_repository_template().glob("*/1/model.py"))
    assert {path.parents[1].name for path in model_files} == {
        "llm",
        "llm_trtllm",
        "ensemble",
        "tensorrt_llm_bls",
    }
    for path in model_files:
        text = path.read_text()
        assert len(text.splitlines()) <= MAX_SHIM_LINES, path
        assert re.search(r"^from paged_llm\.triton_model\.\w+ import TritonPythonModel$", text, re.M), path


def test_the_checkouts_model_repository_is_the_template() -> None:
    """One copy: the top-level `model_repository` (make serve-triton, the README) links to it."""
    assert (repo_root() / "model_repository").resolve() == model_repository_template()


def test_the_wheel_declares_every_file_of_the_template() -> None:
    pyproject = tomllib.loads((repo_root() / "backend_src" / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["paged_llm"]
    package = model_repository_template().parent
    files = [
        path.relative_to(package).as_posix()
        for path in model_repository_template().rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    ]
    assert files
    missing = [name for name in files if not any(fnmatch(name, pattern) for pattern in patterns)]
    assert not missing, missing
