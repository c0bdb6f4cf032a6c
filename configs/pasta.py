r"""PASTA SFT (issue 5, "Training"): the real SmolLM2-135M-Instruct learns to write `<promise>` plans
and `<async>` chunks, trained with the PASTA mask of the core's builder; and the Baseline-SFT (the
same examples with the tags stripped, the same recipe and seed) as the AR reference model.

Run (CPU: LoRA r=8 on all projections + the new tag rows trained, seq_len 512, batch 4, 150 steps at lr 4e-4,
layers rematerialised):
  python -m selforch_jax.train --config=configs/pasta.py:sft --workdir=out/pasta_sft
  python -m selforch_jax.train --config=configs/pasta.py:baseline --workdir=out/pasta_baseline
  # the Alpaca file annotated on the fly by the rule annotator instead of the built records:
  python -m selforch_jax.train --config=configs/pasta.py:sft,data=alpaca --workdir=out/pasta_sft_alpaca
  # accelerators: full fine-tuning, bf16 compute, seq_len 1024, batch 64, 2000 steps
  python -m selforch_jax.train --config=configs/pasta.py:sft,scale=accel --workdir=gs://.../pasta_sft

Argument: ``STAGE[,key=value,...]``; STAGE is ``sft`` (default) or ``baseline``. Keys: ``data``
(``records`` = ``data/pasta/train.jsonl``, built by ``python -m selforch_jax.data.pasta_data``
from Alpaca, the Alpaca seed tasks and MT-Bench reference responses plus the base model's own
responses, annotated by ``pasta_rules``; ``alpaca`` = the Alpaca file with ``data.annotator =
pasta_rules`` run in the pipeline), ``model`` (a preset; ``smollm2_135m`` loads the GGUF weights,
others are random with the SmolLM2 tokenizer), ``scale`` (cpu | accel), ``steps``, ``seq_len``,
``batch_size``, ``lora_rank`` (-1 = the scale's default), ``repeats`` (``data.annotated_repeats``:
each annotated training record appears this many times per epoch, in both stages; default 3, which
makes the annotated records about half of the training rows (1797 per epoch, 903 of them annotated
copies); the tag-less three quarters otherwise teach the model that an answer rarely starts with a
plan; ``data=records`` only).

Both stages use a model with the tags in its vocabulary (``model.tags``; rows initialised to the
mean embedding) and one example per row (``data.annotated``, no packing): PASTA rows carry the
mask builder's ``mask`` (a chunk sees the prefix and the plan up to its promise, not its siblings;
the PLAN sees no chunk; after ``<sync/>`` all is visible) and positions (chunk k starts at
``base + sum_{j<k} 10 N_j``); the target after each ``</async>`` (the runtime writes the next
``<async>``/``<sync/>``) is not trained. The baseline rows have ``data.strip_tags`` (plain text,
causal mask). Held-out eval loss on the same 2% slice for both.
"""

from selforch_jax import config_lib
from selforch_jax.trainers.run import defaults

STAGES = ("sft", "baseline")
DATA = ("records", "alpaca")
BASE_VOCAB = 49152  # SmolLM2 tokenizer size: tag rows start here
RECORDS = "pasta/train.jsonl"  # under data_dir(); see data/pasta/PROVENANCE.md


def get_config(arg=None):
  stage, rest = config_lib.split_stage(arg, STAGES, "configs/pasta.py")
  a = config_lib.parse_arg(rest, data="records", model="smollm2_135m", scale="cpu", steps=-1,
                           seq_len=-1, batch_size=-1, lora_rank=-1, repeats=3)
  if a.data not in DATA:
    raise config_lib.ConfigError(f"configs/pasta.py: data={a.data!r} must be one of {DATA}")
  if a.repeats < 1:
    raise config_lib.ConfigError(f"configs/pasta.py: repeats={a.repeats} must be >= 1")
  if a.repeats != 3 and a.data != "records":
    raise config_lib.ConfigError("configs/pasta.py: repeats applies to data=records (the built "
                                 f"records mark which are annotated), not data={a.data!r}")
  if a.scale not in ("cpu", "accel"):
    raise config_lib.ConfigError(f"configs/pasta.py: scale={a.scale!r} must be 'cpu' or 'accel'")
  accel = a.scale == "accel"
  baseline = stage == "baseline"

  c = defaults()
  c.trainer = "sft"
  c.model.preset = a.model
  if a.model == "smollm2_135m":
    c.model.weights = "smollm2_gguf"
  else:
    c.model.weights, c.model.tokenizer = "random", "smollm2_gguf"
  c.model.tags = True           # same vocabulary for both stages (the baseline never uses the tags)
  lora = a.lora_rank if a.lora_rank >= 0 else (0 if accel else 8)
  c.model.lora_rank = lora
  c.model.lora_alpha = 2.0 * lora if lora else 16.0
  if accel:
    c.model.dtype = "bfloat16"
  else:
    c.model.remat = True        # CPU: 2.8 GB instead of 7 GB (a 7 GB run was OOM-killed here)
  c.train.train_embed_rows_from = BASE_VOCAB if lora else -1  # LoRA: train the new tag rows too
  c.train.new_rows_lr_mult = 25.0 if lora else 1.0  # tag rows start at the mean: let them move

  c.data.annotated = True
  c.data.packing = False
  if a.data == "records":
    c.data.name, c.data.path = "chat", RECORDS
  else:
    c.data.name = "alpaca"
    c.data.annotator = None if baseline else "pasta_rules"
  c.data.strip_tags = baseline
  c.data.annotated_repeats = a.repeats if a.data == "records" else 1
  c.data.seq_len = a.seq_len if a.seq_len > 0 else (1024 if accel else 512)
  c.data.batch_size = a.batch_size if a.batch_size > 0 else (64 if accel else 4)
  c.data.num_epochs = None      # repeat; the run length is train.steps
  c.data.eval_fraction = 0.02   # the same held-out slice for both stages
  c.data.shuffle_seed = 0
  c.data.num_threads = 8 if accel else 1

  steps = a.steps if a.steps > 0 else (2000 if accel else 150)
  c.train.steps = steps
  c.train.seed = 0
  c.train.log_every = 1 if not accel else 10
  c.train.eval_every = max(steps // 3, 1)
  c.train.eval_batches = 2
  c.train.checkpoint_every = max(steps // 2, 1)
  c.train.keep = 2
  c.optim.lr = 4e-4 if lora else 2e-5
  c.optim.warmup_steps = 5 if not accel else 50
  c.optim.schedule = "cosine"
  c.optim.clip_norm = 1.0
  return c
