r"""PASTA policy optimization: BoNBoN / IPO rounds (PASTA paper §4) on Alpaca training
instructions (the SFT data's prompts; AlpacaEval stays held out for evaluation).

Each round samples ``bonbon.num_samples`` responses per prompt with the PASTA scheduler (the
runtime forks a thread per promise), scores each response

  score = theoretical_speedup + lambda * quality,
  theoretical_speedup = response tokens / critical-path decode steps (trainers/bonbon.py:
                        1.0 for a plain AR answer, more when threads run in parallel),
  quality = -(mean per-token NLL of the response under pi_ref)   (judge-free, the default;
            bonbon.quality=judge: the pairwise judge's score against the reference answer),

with lambda = ``bonbon.quality_weight`` (arg ``quality_weight``), pairs the best and the worst
response of each prompt and trains alpha * SFT(best) + IPO against the initial model
(``trainers/bonbon.py``). The training forward uses the rollout's ``build_layout`` mask
(``bonbon.layout_mask``), so it sees what the runtime saw.

Run (the policy is the PASTA SFT run in ``out/pasta_sft``; defaults sized for the real SmolLM2 on
one CPU core: 6 rounds of 8 prompts x 4 samples, about 4.5 min per round):
  python -m selforch_jax.train --config=configs/pasta_po.py:init_from=out/pasta_sft,quality_weight=1 \
      --workdir=out/pasta_po_l1
  # a round's policy as an adapter (checkpoints are numbered in optimizer steps: round r is
  # step r * bonbon.updates_per_round; --round does that arithmetic; here round 3 = step 12)
  python -m selforch_jax.export --workdir=out/pasta_po_l1 --round=3 --out=out/po_l1_r3 --adapter
  # quality from a pairwise judge against the Alpaca reference answers (the paper's quality):
  ... --config.bonbon.quality=judge --config.bonbon.judge.backend=openai \
      --config.bonbon.judge.url=http://localhost:8000/v1 --config.bonbon.judge.model=NAME
  # tiny smoke run (random weights, the real tokenizer):
  python -m selforch_jax.train --config=configs/pasta_po.py:model=tiny_smollm2,steps=1 \
      --config.bonbon.max_new_tokens=8 --workdir=/tmp/pasta_po

Arguments (``:k=v,...``): model (preset; smollm2_135m loads the GGUF weights), init_from (an SFT
workdir, "" = the model section), scheduler (default "pasta" when the runtime registers it,
else "ar"), quality_weight (lambda), steps (rounds), lora_rank.
"""

from selforch_jax import config_lib
from selforch_jax.runtime.schedulers import available
from selforch_jax.runtime.schedulers.pasta import DEFAULT_MAX_THREADS, DEFAULT_MAX_TOPIC_TOKENS
from selforch_jax.trainers.po_run import po_defaults


def get_config(arg=None):
  a = config_lib.parse_arg(arg, model="smollm2_135m", init_from="",
                           scheduler="pasta" if "pasta" in available() else "ar",
                           quality_weight=1.0, steps=6, lora_rank=8)
  c = po_defaults("bonbon")
  c.model.preset = a.model
  if a.model == "smollm2_135m":
    c.model.weights = "smollm2_gguf"
  else:
    c.model.weights = "random"
    c.model.tokenizer = "smollm2_gguf"
  c.model.tags = True
  c.model.lora_rank = a.lora_rank
  c.model.lora_alpha = 2.0 * a.lora_rank if a.lora_rank else 16.0
  b = c.bonbon
  b.init_from = a.init_from or None
  b.scheduler = a.scheduler
  if a.scheduler == "pasta":  # rollouts under the tag grammar (the IPO/SFT terms re-score them)
    b.scheduler_kwargs = {"constrain_tags": True, "max_threads": DEFAULT_MAX_THREADS,
                          "max_topic_tokens": DEFAULT_MAX_TOPIC_TOKENS}
  b.layout_mask = True
  b.score = "pasta"
  b.quality = "ref_nll"
  b.quality_weight = a.quality_weight
  b.num_samples = 4
  b.prompts_per_round = 8       # 32 rollouts of <= 256 tokens per round, decoded together
  b.updates_per_round = 4       # 2 passes over the round's 8 best-vs-worst pairs
  b.pairs_per_step = 4
  b.max_new_tokens = 256        # the eval's answer budget
  if a.model == "smollm2_135m":
    b.num_pages = 2048          # 32 rollouts x (prompt + 256 tokens + a partial page per thread)
  b.temperature = 0.8
  b.alpha = 1.0
  b.tau = 0.1
  b.max_prompt_tokens = 200
  b.dataset, b.split = "alpaca", "train"
  c.optim.lr = 2e-4 if a.lora_rank else 1e-5
  c.optim.warmup_steps = 0
  c.optim.schedule = "constant"
  c.train.steps = a.steps
  c.train.checkpoint_every = 1
  c.train.keep = 10             # the last 10 rounds' checkpoints (the Pareto plot's rounds)
  return c
