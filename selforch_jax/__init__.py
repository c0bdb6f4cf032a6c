"""selforch_jax: self-orchestrating language models in JAX/Flax NNX.

See ``DESIGN.md``-style notes in the README. Subpackages:
``models`` (NNX decoder zoo), ``checkpoints`` (GGUF / HF safetensors / Orbax),
``tokenizers`` (one interface over HF tokenizers and sentencepiece),
``decoding`` (jitted prefill + KV-cache decode).
"""

__version__ = "0.1.0"
