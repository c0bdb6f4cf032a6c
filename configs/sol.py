r"""SOL (issue 22; akhauriyash/SOL, seed_systems.md §1 / §6.3): train a per-token compute policy
(QUEST attention keep x MLP channel keep x MLP-output bits) for the frozen SmolLM2-135M-Instruct
by GRPO over K counterfactual compute schedules on teacher-forced episodes. Values marked
``# CPU`` are small-scale overrides (2 shared CPU cores); the rest are upstream's
(official_configs/All_Variants_*.yml: gamma 0.85, tolerance 0.02, alpha 100/100/200, K 16, T 16,
PPO clip 0.2, entropy 0.05, rollout temperature 1.3, AdamW 1e-4, grad clip 2.0).

Run:
  python -m selforch_jax.train --config=configs/sol.py --workdir=out/sol
  # decode with the adapter it writes (<workdir>/adapter unless sol.adapter_out is set):
  python -m selforch_jax.decode --config=configs/smollm2_135m.py --config.runtime=sol \
      --config.adapter=out/sol/adapter --config.sol.budget=0.5,0.8,8 --prompt="..."

Arguments (``:k=v,...``): ``model`` (a preset; smollm2_135m loads the GGUF weights, others are
random with the SmolLM2 tokenizer), ``steps``, ``grid`` (cpu | readme | upstream), ``w`` (the
KL weight of the reward: 0 = log-likelihood, upstream's LCE; 1 = -KL to dense, DKL), ``minutes``
(wall-clock cap, 0 = none), ``adapter_out``.

Data: chat-formatted GSM8K train solutions and Alpaca outputs (never AlpacaEval, AIME or test
splits): one window of context_len + T + 1 tokens per example.
"""

from selforch_jax import config_lib
from selforch_jax.trainers.sol_run import defaults


def get_config(arg=None):
  a = config_lib.parse_arg(arg, model="smollm2_135m", steps=300, grid="cpu", w=0.0, minutes=0.0,
                           adapter_out="")
  c = defaults()
  c.model.preset = a.model
  if a.model == "smollm2_135m":
    c.model.weights = "smollm2_gguf"
  else:
    c.model.weights = "random"
    c.model.tokenizer = "smollm2_gguf"
  c.model.lora_rank = 0
  s = c.sol
  s.grid = a.grid                 # CPU: 3 x 3 x 3 (upstream: 10 x 13 x 12)
  s.task_w_kl = a.w
  s.context_len = 48              # CPU (upstream 512)
  s.rollout_len = 8               # CPU (upstream 16)
  s.rollouts = 8                  # CPU (upstream 16)
  s.batch_size = 8                # CPU (B sequences x K rollouts per update)
  s.d_model = 128                 # CPU (upstream 512)
  s.lr = 1e-3                     # CPU: few updates (upstream 1e-4)
  s.ppo_epochs = 2                # CPU: two passes over each batch (upstream one epoch)
  s.sources = "gsm8k:2000,alpaca:400"
  s.eval_every = 15
  s.max_minutes = a.minutes
  s.adapter_out = a.adapter_out
  c.train.steps = a.steps
  return c
