"""Shared fixtures."""

import gc

import jax
import pytest


@pytest.fixture(scope="session")
def tiny_tagged_model_dir(tmp_path_factory):
  """A Hugging Face directory of the tiny random SmolLM2 with the orchestration tags (what the
  PASTA eval's ``pareto`` runs and model paths accept), and its model config section."""
  from selforch_jax import config_lib
  from selforch_jax.checkpoints.safetensors_io import export_hf
  from selforch_jax.trainers.run import defaults
  mc = defaults().model
  mc.preset, mc.weights, mc.tokenizer, mc.tags, mc.seed = "tiny_smollm2", "random", "smollm2_gguf", True, 1
  _, model, tok = config_lib.load_model(mc)
  return export_hf(model, model.cfg, str(tmp_path_factory.mktemp("tiny_tagged") / "hf"),
                   tokenizer=tok)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drop JAX's compiled programs after each test module: XLA:CPU maps memory for every
  executable, and a whole-suite run in one process otherwise reaches the kernel's
  ``vm.max_map_count`` (65530 here) and segfaults inside a later compile."""
  yield
  jax.clear_caches()
  gc.collect()
