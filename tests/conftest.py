"""Shared fixtures, and one persistent XLA compilation cache for the whole test session."""

import atexit
import gc
import os
import shutil
import tempfile

# Many modules (and the CLI subprocesses they start, which inherit the environment) compile the
# same programs of the same tiny and real models; ``_release_compiled_programs`` drops JAX's
# in-memory cache after every module, so without a disk cache each later module compiles them
# again. The cache is fresh for each session (a run never depends on an earlier one) unless
# JAX_COMPILATION_CACHE_DIR is set; a cached executable is the one XLA would compile. Under
# pytest-xdist (``make test`` runs ``-n 2 --dist loadfile``: a module and its fixtures on one
# worker) the controller loads this file before it starts the workers, so they inherit the
# variable and share the one cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="selforch_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  atexit.register(shutil.rmtree, _cache_dir, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402  (after the cache settings, which JAX reads at import)
import pytest  # noqa: E402

# in case a plugin imported JAX before this file: the same settings, set directly
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


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
