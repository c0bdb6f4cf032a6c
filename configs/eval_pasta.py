r"""PASTA vs AR, Skeleton-of-Thought and APAR on AlpacaEval prompts (issue 5).

Run:
  python -m selforch_jax.eval --config=configs/eval_pasta.py --workdir=out/eval_pasta \
      --config.pasta=out/pasta_sft --config.baseline=out/pasta_baseline
  python -m selforch_jax.eval --config=configs/eval_pasta.py --config.n=10 \
      --config.max_new_tokens=128 --workdir=out/eval_pasta_small   # base SmolLM2 + tag rows
  ... --config.pareto=lam1/r3=out/po_l1_r3,lam1/r6=out/po_l1_r6   # PASTA runs per λ / round
                                                      # (Pareto plot: one line per λ)
  ... --config.judge.backend=openai --config.judge.url=https://api.openai.com/v1 \
      --config.judge.model=gpt-4o-mini                  # judge win rate vs AR (key: $OPENAI_API_KEY)
  ... --config.forced.n=3 --config.forced.promises=6    # forced-plan thread speedup

Keys: see ``selforch_jax.eval.pasta.defaults``. Outputs: ``DIR/pasta_eval.json``,
``DIR/pasta_eval_records.jsonl``, ``DIR/pasta_pareto.png``.
"""

from selforch_jax.eval.pasta import defaults


def get_config(arg=None):
  if arg:
    from selforch_jax.config_lib import ConfigError
    raise ConfigError(f"configs/eval_pasta.py takes no ':' argument (got {arg!r}); set values "
                      "with --config.KEY=VALUE, e.g. --config.n=10")
  c = defaults()
  c.model.preset = "smollm2_135m"
  c.model.weights = "smollm2_gguf"
  c.model.tags = True
  return c
