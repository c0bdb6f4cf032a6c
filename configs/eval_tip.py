r"""TIP vs dense, StreamingLLM, H2O and paged H2O at matched live-KV budgets (issue 6).

Run:
  python -m selforch_jax.eval --config=configs/eval_tip.py --config.tip=out/tip_sft \
      --config.dense=out/tip_dense_sft --workdir=out/eval_tip
  python -m selforch_jax.eval --config=configs/eval_tip.py:n=10,max_new_tokens=128,datasets=gsm8k \
      --workdir=out/eval_tip_small        # base SmolLM2 with tag rows, before any training
  python -m selforch_jax.eval --config=configs/eval_tip.py:datasets=math500+aime --workdir=out/eval_tip_math
  # models trained per dataset, in one run:
  python -m selforch_jax.eval --config=configs/eval_tip.py:datasets=synthetic_chain \
      --config.tip_for.synthetic_chain=out/tip_chain_sft \
      --config.dense_for.synthetic_chain=out/tip_chain_dense_sft --workdir=out/eval_tip_chain
  # two shards over problems 0..149 and 150..299 (one per core or host), merged into one report:
  python -m selforch_jax.eval --config=configs/eval_tip.py:n=150,offset=150,datasets=synthetic_walk \
      ... --workdir=out/walk_b      # and offset=0 -> out/walk_a
  python -m selforch_jax.eval.tip_merge --out=out/walk out/walk_a out/walk_b

Arguments: n (problems per dataset, rows offset..offset+n-1 of each test file; default 300),
offset (default 0), max_new_tokens, batch_size, datasets (``+``-separated: gsm8k,
synthetic_chain, synthetic_walk, math500, aime), budget (tip_mean, tip_peak or an integer number
of tokens). Output: ``DIR/tip_eval.json``,
``DIR/tip_<dataset>_<system>.jsonl``, ``DIR/tip_accuracy_vs_live_kv.png``.
"""

from selforch_jax import config_lib
from selforch_jax.eval.tip import defaults


def get_config(arg=None):
  a = config_lib.parse_arg(arg, n=300, offset=0, max_new_tokens=256, batch_size=8,
                           datasets="gsm8k+synthetic_chain", budget="tip_mean")
  c = defaults()
  c.model.preset = "smollm2_135m"
  c.model.weights = "smollm2_gguf"
  c.model.tags = True
  c.eval.n = a.n
  c.eval.offset = a.offset
  c.eval.max_new_tokens = a.max_new_tokens
  c.eval.batch_size = a.batch_size
  c.eval.datasets = a.datasets.replace("+", ",")
  c.eval.budget = a.budget
  return c
