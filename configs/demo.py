r"""Main job of the README: the real SmolLM2-135M-Instruct answers 20 AlpacaEval prompts and
10 GSM8K test questions from data/, greedy, batched, through our jitted KV-cache decoder.

Run:
  python -m selforch_jax.decode --config=configs/demo.py --workdir=out/demo
Writes out/demo/answers.jsonl and out/demo/summary.json (throughput).
"""

from selforch_jax import config_lib
from selforch_jax.decoding.run import defaults


def get_config(arg=None):
  a = config_lib.parse_arg(arg, alpaca_eval=20, gsm8k=10, max_new_tokens=192, batch_size=10)
  c = defaults()
  c.model.preset = "smollm2_135m"
  c.model.weights = "smollm2_gguf"
  c.inputs = f"alpaca_eval:{a.alpaca_eval},gsm8k:{a.gsm8k}"
  c.max_new_tokens = a.max_new_tokens
  c.batch_size = a.batch_size
  return c
