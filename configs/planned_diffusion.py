r"""Planned Diffusion (issue 21; planned-diffusion/planned-diffusion, thesis_systems.md §3): one
model (SmolLM2-135M-Instruct + LoRA + the tag rows, like the PASTA adapter) learns the AR plan
(``<promise> CITY N </promise>`` per city, then ``<async>``) and the masked-diffusion chunks (one
fixed-form sentence per city) of the synthetic cities task (:mod:`selforch_jax.data.
synthetic_cities`, k = 2..6 cities, train seed 0; evaluation uses other seeds), with the joint loss
(AR CE + (1/t) masked CE). Values marked ``# CPU`` are small-scale overrides (2 shared cores;
upstream: Dream-7B, full fine-tune, 16 epochs of annotated SlimOrca on 4xH200).

Run:
  python -m selforch_jax.train --config=configs/planned_diffusion.py --workdir=out/pd
  # the AR-SFT baseline (upstream --autoregressive_only): the same records, tags stripped
  python -m selforch_jax.train --config=configs/planned_diffusion.py:ar_only --workdir=out/pd_ar
  # ablations: generic topics, no <sync/>, dense attention inside a round
  python -m selforch_jax.train --config=configs/planned_diffusion.py:no_topic --workdir=out/pd_nt
  # PASTA on the same task (the records without [PAD], PASTA's mask: a chunk sees the plan up to
  # its promise and is causal; plain masked CE); decode with --config.runtime=pasta
  python -m selforch_jax.train --config=configs/planned_diffusion.py:pasta --workdir=out/pasta_c
  # decode with the adapter the run writes (<workdir>/adapter unless adapter_out is set):
  python -m selforch_jax.decode --config=configs/smollm2_135m.py \
      --config.runtime=planned_diffusion --config.adapter=out/pd/adapter --prompt="..."

Argument: ``STAGE[,key=value,...]``; STAGE is ``pd`` (default), ``ar_only``, ``no_topic``,
``no_sync``, ``full_attention`` or ``pasta``. Keys: ``model`` (a preset; smollm2_135m loads the
GGUF weights, others are random with the SmolLM2 tokenizer), ``steps``, ``seq_len``, ``batch_size``,
``lora_rank`` (0 = full fine-tune: no adapter is exported, the Orbax checkpoint holds the
weights), ``n`` (training examples), ``lr``, ``ar_over_t`` (upstream's AR/t), ``adapter_out``,
``init_adapter`` (an adapter directory of the same LoRA rank whose LoRA + tag rows the run
starts from, e.g. ``adapters/pd_smollm2_135m`` to continue its training), ``suffix_p`` (the
share of rows whose chunks get a masked suffix instead of i.i.d. masks: the states of the
scheduler's left-to-right ``window=1``; 0 = the issue's i.i.d. rule), ``data``: ``cities``
(default, the synthetic task above) or ``chat`` (the PASTA-annotated chat records of
``data/pasta/train.jsonl`` converted by :func:`selforch_jax.data.planned_diffusion_data.
chat_pd_records`: N = ceil(chunk tokens / 10), 0-10 ``[PAD]`` per chunk capped to the 10*N
scaffold, rows without a plan dropped; ``n`` is then unused), e.g.
``configs/planned_diffusion.py:pd,data=chat,steps=110,batch_size=2,lr=1e-3``.
"""

from selforch_jax import config_lib
from selforch_jax.trainers.run import defaults

STAGES = ("pd", "ar_only", "no_topic", "no_sync", "full_attention", "pasta")
BASE_VOCAB = 49152  # SmolLM2 tokenizer size: tag rows start here
DATA = ("cities", "chat")


def get_config(arg=None):
  stage, rest = config_lib.split_stage(arg, STAGES, "configs/planned_diffusion.py")
  a = config_lib.parse_arg(rest, model="smollm2_135m", steps=120, seq_len=512, batch_size=4,
                           lora_rank=8, n=2000, lr=4e-4, ar_over_t=False, adapter_out="",
                           init_adapter="", data="cities", suffix_p=0.0)
  if a.data not in DATA:
    raise config_lib.ConfigError(f"configs/planned_diffusion.py: data={a.data!r} must be one of "
                                 f"{DATA}")
  if a.lora_rank < 0 or a.steps < 1 or a.n < 1:
    raise config_lib.ConfigError("configs/planned_diffusion.py: steps and n must be >= 1, "
                                 "lora_rank >= 0 (0 = full fine-tune)")
  c = defaults()
  c.trainer = "planned_diffusion"
  c.model.preset = a.model
  if a.model == "smollm2_135m":
    c.model.weights = "smollm2_gguf"
  else:
    c.model.weights, c.model.tokenizer = "random", "smollm2_gguf"
  c.model.tags = True
  c.model.lora_rank = a.lora_rank           # CPU: LoRA (upstream: full fine-tune = lora_rank=0)
  c.model.lora_alpha = 2.0 * a.lora_rank
  c.model.remat = True                      # CPU memory
  c.train.train_embed_rows_from = BASE_VOCAB  # the new tag rows train too
  c.train.new_rows_lr_mult = 25.0           # as PASTA SFT: mean-initialised rows must move

  p = c.planned_diffusion
  p.ar_only = stage == "ar_only"
  p.no_topic = stage == "no_topic"
  p.no_sync = stage == "no_sync"
  p.full_attention = stage == "full_attention"
  p.pasta = stage == "pasta"
  p.ar_over_t = bool(a.ar_over_t)
  p.source = a.data                         # cities | chat (the records the run writes)
  p.cities_n = a.n                          # CPU: 2000 examples (seed 0); chat: unused
  p.cities_seed = 0
  p.adapter_out = a.adapter_out
  p.init_adapter = a.init_adapter
  p.suffix_p = float(a.suffix_p)           # semi-autoregressive noise share (0 = the issue's)

  c.data.name = "chat"
  c.data.annotated = True
  c.data.packing = False
  c.data.strip_tags = p.ar_only
  pd_layout = not (p.ar_only or p.pasta)
  c.data.async_sees_full_plan = pd_layout     # the Planned Diffusion layout (PASTA: its own)
  c.data.chunk_bidirectional = pd_layout
  c.data.seq_len = a.seq_len                # k = 6 answers fit in 512 tokens
  c.data.batch_size = a.batch_size
  c.data.num_epochs = None                  # repeat; the run length is train.steps
  c.data.eval_fraction = 0.02
  c.data.shuffle_seed = 0
  c.data.num_threads = 1

  c.train.steps = a.steps                   # CPU
  c.train.seed = 0
  c.train.log_every = 1
  c.train.eval_every = max(a.steps // 3, 1)
  c.train.eval_batches = 2
  c.train.checkpoint_every = max(a.steps // 4, 1)
  c.train.keep = 2
  c.optim.lr = a.lr
  c.optim.warmup_steps = 5
  c.optim.schedule = "cosine"
  c.optim.clip_norm = 1.0
  return c
