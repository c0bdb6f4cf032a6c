r"""Main job of the README: the real SmolLM2-135M-Instruct answers 20 AlpacaEval prompts and
10 GSM8K test questions from data/, greedy, batched, through our jitted KV-cache decoder; then
the committed PASTA adapter (``adapters/pasta_smollm2_135m``: LoRA + tag rows) decodes the last
6 of those AlpacaEval prompts (held out: AlpacaEval never enters PASTA training) with PASTA
parallel decoding and, on the same engine, plain AR, batch 1, both timed.

Run:
  python -m selforch_jax.decode --config=configs/demo.py --workdir=out/demo
Writes out/demo/answers.jsonl, out/demo/pasta.jsonl and out/demo/summary.json (throughput, and
the PASTA part's threads, tokens per forward, AR/PASTA wall ratio and parse rate).
``configs/demo.py:pasta=`` (empty) skips the PASTA part; ``pasta_n``, ``pasta_tokens`` size it.
"""

from selforch_jax import config_lib
from selforch_jax.decoding.run import defaults


def get_config(arg=None):
  a = config_lib.parse_arg(arg, alpaca_eval=20, gsm8k=10, max_new_tokens=192, batch_size=10,
                           pasta="adapters/pasta_smollm2_135m", pasta_n=6, pasta_tokens=256)
  c = defaults()
  c.model.preset = "smollm2_135m"
  c.model.weights = "smollm2_gguf"
  c.inputs = f"alpaca_eval:{a.alpaca_eval},gsm8k:{a.gsm8k}"
  c.max_new_tokens = a.max_new_tokens
  c.batch_size = a.batch_size
  c.pasta.adapter = a.pasta
  c.pasta.alpaca_eval = a.pasta_n
  c.pasta.offset = max(a.alpaca_eval - a.pasta_n, 0)  # the base part's last AlpacaEval prompts
  c.pasta.max_new_tokens = a.pasta_tokens
  return c
