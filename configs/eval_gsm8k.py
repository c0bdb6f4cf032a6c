r"""GSM8K test exact match for the base SmolLM2-135M-Instruct and a fine-tuned run, same subset.

Run:
  python -m selforch_jax.eval --config=configs/eval_gsm8k.py --config.finetuned=out/sft --workdir=out/eval
  python -m selforch_jax.eval --config=configs/eval_gsm8k.py:n=300 --workdir=out/eval300   # base only

Arguments: n (questions, the first n of test.jsonl), max_new_tokens, batch_size.
"""

from selforch_jax import config_lib
from selforch_jax.eval.run import defaults


def get_config(arg=None):
  a = config_lib.parse_arg(arg, n=100, max_new_tokens=256, batch_size=16)
  c = defaults()
  c.model.preset = "smollm2_135m"
  c.model.weights = "smollm2_gguf"
  c.eval.dataset = "gsm8k"
  c.eval.n = a.n
  c.eval.max_new_tokens = a.max_new_tokens
  c.eval.batch_size = a.batch_size
  return c
