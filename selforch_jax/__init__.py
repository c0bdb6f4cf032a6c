"""selforch_jax: self-orchestrating language models in JAX/Flax NNX.

See ``DESIGN.md``-style notes in the README. Subpackages:
``models`` (NNX decoder zoo), ``checkpoints`` (GGUF / HF safetensors / Orbax),
``tokenizers`` (one interface over HF tokenizers and sentencepiece),
``runtime`` (the engine and every decoding system's scheduler: the only decode loop).

The public API is :func:`selforch_jax.generate` (:mod:`selforch_jax.api`), loaded on first use
so that ``import selforch_jax`` stays light.
"""

__version__ = "0.1.0"

__all__ = ["generate", "Answer"]


def __getattr__(name):
  if name in ("generate", "Answer"):
    from selforch_jax import api
    return getattr(api, name)
  raise AttributeError(f"module 'selforch_jax' has no attribute {name!r}")
