r"""Orthrus (issue 20; chiennv2000/orthrus, seed_systems.md §2): train the diffusion attention view
of SmolLM2-135M-Instruct by KL distillation to the frozen AR model, on the model's own greedy
continuations of training prompts. Values marked ``# CPU`` are small-scale overrides (2 shared
CPU cores); upstream ships no trainer (its paper / post: KL > CE, single-step denoising, block 32,
< 1B tokens on 8xH200).

Run:
  python -m selforch_jax.train --config=configs/orthrus.py --workdir=out/orthrus
  # CE instead of KL (the paper's comparison), a full-copy view (as upstream) instead of low rank:
  python -m selforch_jax.train --config=configs/orthrus.py:loss=ce --workdir=out/orthrus_ce
  python -m selforch_jax.train --config=configs/orthrus.py:view_rank=0 --workdir=out/orthrus_full
  # multi-step denoising (MDLM-style partially revealed blocks; the paper found single better),
  # decoded with denoise steps (--config.orthrus.denoise_steps=2):
  python -m selforch_jax.train --config=configs/orthrus.py:denoise=multi --workdir=out/orthrus_multi
  # decode with the adapter the run writes (<workdir>/adapter unless orthrus.adapter_out is set):
  python -m selforch_jax.decode --config=configs/smollm2_135m.py --config.runtime=orthrus \
      --config.adapter=out/orthrus/adapter --prompt="..."

Arguments (``:k=v,...``): ``model`` (a preset; smollm2_135m loads the GGUF weights, others are
random with the SmolLM2 tokenizer), ``loss`` (kl | ce), ``denoise`` (single | multi),
``block_size``, ``view_rank`` (0 = full view copies), ``steps``, ``seq_len``, ``batch_size``,
``sources`` (``gsm8k:N+alpaca:M``; train splits only), ``max_new_tokens`` (continuation budget),
``data_path`` (the cache file, relative to ``data/``).

Data: the first N rows of GSM8K train and Alpaca (never AlpacaEval, MATH-500 or AIME), each
continued greedily by the engine (AR, up to ``max_new_tokens``), cached as a chat JSONL with a
``.provenance.json`` beside it (written on the first run, reused while the request matches).
"""

from selforch_jax import config_lib
from selforch_jax.trainers.run import defaults


def get_config(arg=None):
  a = config_lib.parse_arg(arg, model="smollm2_135m", loss="kl", denoise="single", block_size=8,
                           view_rank=16, steps=120, seq_len=320, batch_size=4,
                           sources="gsm8k:96,alpaca:32", max_new_tokens=128,
                           data_path="orthrus/smollm2_135m_greedy.jsonl")
  c = defaults()
  c.trainer = "orthrus"
  c.model.preset = a.model
  if a.model == "smollm2_135m":
    c.model.weights = "smollm2_gguf"
  else:
    c.model.weights = "random"
    c.model.tokenizer = "smollm2_gguf"
  c.model.lora_rank = 0
  c.orthrus.loss = a.loss
  c.orthrus.denoise = a.denoise          # upstream: single
  c.orthrus.block_size = a.block_size    # CPU: 8 (upstream post: 32)
  c.orthrus.view_rank = a.view_rank      # CPU / adapter size: low rank (upstream: full copies)
  c.orthrus.sources = a.sources          # CPU: 128 prompts (upstream: < 1B tokens)
  c.orthrus.max_new_tokens = a.max_new_tokens
  c.data.name = "chat"
  c.data.path = a.data_path
  c.data.packing = False
  c.data.seq_len = a.seq_len
  c.data.batch_size = a.batch_size
  c.data.num_epochs = None               # repeat; the run length is train.steps
  c.data.eval_fraction = 0.1             # held-out continuations for the acceptance curve
  c.optim.lr = 1e-3                      # low-rank deltas (B starts at 0)
  c.optim.warmup_steps = 10
  c.optim.schedule = "cosine"
  c.optim.clip_norm = 1.0
  c.train.steps = a.steps
  c.train.log_every = 1
  c.train.eval_every = max(a.steps // 6, 1)
  c.train.eval_batches = 3
  c.train.checkpoint_every = max(a.steps // 2, 1)
  c.train.keep = 2
  return c
