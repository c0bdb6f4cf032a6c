r"""PTD (Progressive Tree Drafting, MINE-USTC/PTD) and its baselines (PLD, Lookahead): scheduler
options in one place. Upstream values are marked ``# upstream``; small-scale (2 CPU cores,
SmolLM2-135M) overrides are marked ``# CPU``.

Run:
  python -m selforch_jax.decode --config=configs/ptd.py --prompt="Name three colors."
  python -m selforch_jax.decode --config=configs/ptd.py:runtime=pld --prompt="..."
  python bench/speculative.py --n=3 --new_tokens=32 --out=out/speculative_smoke.json

Argument: ``runtime=ptd|pld|lookahead|ar,scale=cpu|upstream`` (default ``ptd``, ``cpu``).
:func:`options` returns the keyword options of ``make_scheduler(runtime, ...)``.

Sizing (beyond upstream): a step runs ``1 + max_tree`` queries at most; the engine pads T to a
power of two, so a step of 9..16 queries costs the same. On this machine
(``bench/results/engine_step_cpu.json``) T = 16 costs about 1.9x T = 1 and T = 32 about 2.9x;
:func:`selforch_jax.runtime.schedulers.ptd.choose_sizes` picks the bucket and the guess budget
that maximise expected committed tokens per second from that curve and a measured acceptance
curve (``bench/speculative.py`` calibrates and records the chosen sizes in its JSON); the draft
tree takes the rest of the bucket. Upstream feeds ``1 + |draft| + |guess|`` ~ 100 tokens, which
suits a GPU.
"""

from selforch_jax import config_lib

# upstream: configs/tree_config.json (MAX_DEPTH, MAX_CHILD_NUM, min_child_num, ini_max_depth) and
# cache_server.py (MAX_N, PLD_INI)
PTD_UPSTREAM = dict(
    max_depth=6,        # upstream
    max_child=4,        # upstream
    min_child=4,        # upstream: the root wants 4 first-level children
    ini_max_depth=2,    # upstream: initial chains of depth <= 2 of random prompt tokens
    ini_nodes=2,        # upstream: 2 initial first-level nodes
    trie_cap=60,        # upstream: MAX_N nodes per trie
    pld_init=False,     # upstream default off (PLD_INI seeds the prompt's 5-grams)
    pld_n=5,            # upstream: 5-grams
    max_tree=100,       # upstream scale: ~ 1 + |draft| + |guess| = 100 tokens per step
    max_guess=60,       # upstream: the whole trie (<= MAX_N)
)
PTD_CPU = dict(
    PTD_UPSTREAM,
    max_depth=4,        # CPU: a 15-node draft reaches depth 4, not 6 (cache fills need it)
    max_child=2,        # CPU
    min_child=2,        # CPU
    pld_init=True,      # CPU: prompt 5-gram seeding on
    cache_from_output=True,  # beyond upstream: committed 5-grams enter the cache too
    lookup_ngram=0,     # beyond upstream, off: a grafted prompt-lookup branch measured 1.54 vs
                        # 1.63 tokens/forward without it (8 GSM8K + MT-Bench prompts, 96 tokens)
    max_tree=15,        # CPU: the T = 16 bucket (choose_sizes on engine_step_cpu.json)
    max_guess=8,        # CPU: choose_sizes' guess budget at T = 16
)
PLD = dict(max_ngram=3, max_tree=15)          # Saxena: max_ngram_size 3; CPU: fill T = 16
PLD_UPSTREAM = dict(max_ngram=3, max_tree=10)  # Saxena: num_pred_tokens 10
LOOKAHEAD_UPSTREAM = dict(window=15, ngram=5, guesses=15)   # Fu et al. 7B setting on A100
LOOKAHEAD = dict(window=3, ngram=4, guesses=3)  # CPU: 1 + 9 + <= 9 queries (the T = 32 bucket
#                                                  only when 3 full candidates exist)

_OPTS = {("ptd", "cpu"): PTD_CPU, ("ptd", "upstream"): PTD_UPSTREAM,
         ("pld", "cpu"): PLD, ("pld", "upstream"): PLD_UPSTREAM,
         ("lookahead", "cpu"): LOOKAHEAD, ("lookahead", "upstream"): LOOKAHEAD_UPSTREAM,
         ("ar", "cpu"): {}, ("ar", "upstream"): {}}


def options(runtime: str = "ptd", scale: str = "cpu") -> dict:
  """Scheduler options of ``runtime`` at ``scale``.

  Raises:
    KeyError: unknown runtime or scale.
  """
  if (runtime, scale) not in _OPTS:
    raise KeyError(f"unknown runtime/scale {runtime!r}/{scale!r}; known: {sorted(_OPTS)}")
  return dict(_OPTS[(runtime, scale)])


def get_config(arg=None):
  """The SmolLM2 decode config with ``runtime`` set (the decode CLI reads the options)."""
  from selforch_jax.decoding.run import defaults
  a = config_lib.parse_arg(arg, runtime="ptd", scale="cpu")
  options(a.runtime, a.scale)
  c = defaults()
  c.model.preset = "smollm2_135m"
  c.model.weights = "smollm2_gguf"
  c.runtime = a.runtime
  c.batch_size = 1
  return c
