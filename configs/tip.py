r"""TIP (Thinking in Place, issue 6): SFT on register-annotated reasoning, then GRPO under eviction,
and the dense baseline with the same data and steps but no register tags.

Run (CPU, real SmolLM2-135M-Instruct, LoRA r=8 + trained tag rows; the first command is the one to
start with):
  python -m selforch_jax.train --config=configs/tip.py --workdir=out/tip_sft        # = :sft
  python -m selforch_jax.train --config=configs/tip.py:grpo --workdir=out/tip_grpo  # from out/tip_sft
  # the dense baseline (same examples, tags stripped; GRPO rollouts without eviction):
  python -m selforch_jax.train --config=configs/tip.py:dense_sft --workdir=out/tip_dense_sft
  python -m selforch_jax.train --config=configs/tip.py:dense_grpo --workdir=out/tip_dense_grpo
  # the synthetic chain task instead of GSM8K:
  python -m selforch_jax.train --config=configs/tip.py:sft,data=synthetic_chain --workdir=out/tip_chain_sft
  python -m selforch_jax.train --config=configs/tip.py:sft,data=synthetic_walk --workdir=out/tip_walk_sft
  # accelerator scale: full fine-tuning, seq_len 2048, batch 64, 2000 steps, bf16 compute,
  # GRPO groups of 16 x 32 prompts with 1024-token rollouts (add --config.mesh.fsdp=N to shard):
  python -m selforch_jax.train --config=configs/tip.py:sft,scale=accel --workdir=gs://.../tip_sft
  python -m selforch_jax.train --config=configs/tip.py:grpo,scale=accel,init_from=gs://.../tip_sft \
      --workdir=gs://.../tip_grpo

Argument: ``STAGE[,key=value,...]``; STAGE is ``sft`` (default), ``grpo``, ``dense_sft`` or
``dense_grpo``. Keys: ``data`` (gsm8k | synthetic_chain | synthetic_walk), ``model`` (a preset; smollm2_135m loads
the GGUF weights, others are random with the SmolLM2 tokenizer), ``scale`` (cpu | accel),
``num_registers`` (K), ``steps``, ``seq_len``, ``batch_size``, ``lora_rank`` (-1 = the scale's
default), ``init_from`` (GRPO: the SFT workdir; default ``out/tip_sft`` / ``out/tip_dense_sft``;
``none`` = start from the ``model`` weights).

Data: GSM8K train solutions annotated by ``tip_gsm8k`` (each line a step, ``<reg_k>`` tags from
linear-scan allocation over the dependence graph; ``data.annotator_args.num_registers`` = K), or
the pre-annotated ``synthetic_chain`` / ``synthetic_walk`` rows (the walk: a short prompt and a
long trace, see :mod:`selforch_jax.data.synthetic_walk`); the dense stages set ``data.strip_tags`` (same words,
no tags). SFT uses the mask builder's mask (a token never sees a step killed before it). GRPO:
rollouts through the ``tip`` scheduler (eviction on; ``dense_grpo``: ``ar``), reward = exact-match
correctness + 0.1 x format (``gsm8k`` reward: an explicit ``#### N`` / ``\boxed{}`` answer),
group-relative advantages, clipped ratio, KL to the SFT model.
"""


from selforch_jax import config_lib
from selforch_jax.trainers.grpo_config import grpo_defaults
from selforch_jax.trainers.run import defaults

STAGES = ("sft", "grpo", "dense_sft", "dense_grpo")
DATA = ("gsm8k", "synthetic_chain", "synthetic_walk")
BASE_VOCAB = 49152  # SmolLM2 tokenizer size: tag rows start here


def get_config(arg=None):
  stage, rest = config_lib.split_stage(arg, STAGES, "configs/tip.py")
  a = config_lib.parse_arg(rest, data="gsm8k", model="smollm2_135m", scale="cpu", num_registers=8,
                           steps=-1, seq_len=-1, batch_size=-1, lora_rank=-1, init_from="")
  if a.data not in DATA:
    raise config_lib.ConfigError(f"configs/tip.py: data={a.data!r} must be one of {DATA}")
  if a.scale not in ("cpu", "accel"):
    raise config_lib.ConfigError(f"configs/tip.py: scale={a.scale!r} must be 'cpu' or 'accel'")
  if a.num_registers < 1:
    raise config_lib.ConfigError(f"configs/tip.py: num_registers={a.num_registers} must be >= 1")
  accel = a.scale == "accel"
  dense = stage.startswith("dense")
  grpo = stage.endswith("grpo")

  c = defaults()
  c.trainer = "grpo" if grpo else "sft"
  # model: tags in the vocabulary (also for the dense baseline: same model, tags never used)
  c.model.preset = a.model
  if a.model == "smollm2_135m":
    c.model.weights = "smollm2_gguf"
  else:
    c.model.weights, c.model.tokenizer = "random", "smollm2_gguf"
  c.model.tags = True
  c.model.num_registers = a.num_registers
  lora = a.lora_rank if a.lora_rank >= 0 else (0 if accel else 8)
  c.model.lora_rank = lora
  c.model.lora_alpha = 2.0 * lora if lora else 16.0
  if accel:
    c.model.dtype = "bfloat16"
  c.train.train_embed_rows_from = BASE_VOCAB if lora else -1  # LoRA: train the new tag rows too
  c.train.new_rows_lr_mult = 25.0 if lora else 1.0  # tag rows start at the mean: let them move

  # data: annotated rows (mask from the builder), one example per row
  c.data.name = a.data
  c.data.annotated = True
  c.data.packing = False
  c.data.annotator = "tip_gsm8k" if a.data == "gsm8k" and not dense else None
  if c.data.annotator:
    c.data.annotator_args = {"num_registers": a.num_registers}
  c.data.strip_tags = dense
  # CPU: 384 tokens hold 97% of annotated GSM8K conversations (SmolLM2 chat template; median 210)
  c.data.seq_len = a.seq_len if a.seq_len > 0 else (2048 if accel else 384)
  c.data.batch_size = a.batch_size if a.batch_size > 0 else (64 if accel else 4)
  c.data.num_epochs = None
  c.data.eval_fraction = 0.02
  c.data.num_threads = 8 if accel else 1

  steps = a.steps if a.steps > 0 else ((2000 if accel else 60) if not grpo else
                                       (500 if accel else 10))
  c.train.steps = steps
  c.train.log_every = 1 if not accel else 10
  c.train.eval_every = 0 if grpo else max(steps // 3, 1)
  c.train.eval_batches = 2
  c.train.checkpoint_every = max(steps // 2, 1)
  c.train.keep = 2
  c.optim.lr = (2e-4 if lora else 2e-5) if not grpo else (2e-5 if lora else 1e-6)
  c.optim.warmup_steps = 5 if not accel else 50
  c.optim.schedule = "cosine"
  c.optim.clip_norm = 1.0

  g = grpo_defaults()
  g.dataset, g.split = a.data, "train"
  g.reward, g.format_weight = "gsm8k", 0.1       # exact match + format term
  g.scheduler = "ar" if dense else "tip"         # TIP rollouts run with eviction on
  g.layout_mask = not dense                      # log-probs under the same TIP mask
  g.group_size = 16 if accel else 4
  g.prompts_per_step = 32 if accel else 2
  # CPU: 160 tokens hold most GSM8K solutions; a 16-step walk needs about 300
  g.max_new_tokens = 1024 if accel else (320 if a.data == "synthetic_walk" else 160)
  g.max_prompt_tokens = 512 if accel else 256
  g.num_pages = 4096 if accel else 256
  g.temperature = 1.0
  init = a.init_from or ("out/tip_dense_sft" if dense else "out/tip_sft")
  if grpo and init.lower() != "none":
    g.init_from = init  # checked by trainers.po_run.validate_po, after command-line overrides
  c.grpo = g
  return c
