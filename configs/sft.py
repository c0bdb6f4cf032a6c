r"""SFT (LoRA by default) of SmolLM2-135M-Instruct on GSM8K train, sized for a 2-core CPU.

Run:
  python -m selforch_jax.train --config=configs/sft.py:model=smollm2_135m,data=gsm8k \
      --config.optim.lr=1e-4 --workdir=out/sft
  # full fine-tuning on an accelerator, bigger batch, 4-way fsdp:
  python -m selforch_jax.train --config=configs/sft.py:lora_rank=0,steps=2000 \
      --config.data.batch_size=64 --config.data.seq_len=1024 --config.mesh.fsdp=4 --workdir=gs://...
  # a toy-width model with the real tokenizer (tests, smoke runs):
  python -m selforch_jax.train --config=configs/sft.py:model=tiny_smollm2 --workdir=/tmp/x

Arguments (``:k=v,...``): model (a preset: smollm2_135m loads the real GGUF weights; any
other preset is randomly initialised with the SmolLM2 tokenizer), data (gsm8k | alpaca),
lora_rank, steps, seq_len, batch_size.
"""

from selforch_jax import config_lib
from selforch_jax.trainers.run import defaults


def get_config(arg=None):
  a = config_lib.parse_arg(arg, model="smollm2_135m", data="gsm8k", lora_rank=8, steps=60,
                           seq_len=256, batch_size=8)
  c = defaults()
  c.model.preset = a.model
  if a.model == "smollm2_135m":
    c.model.weights = "smollm2_gguf"
  else:
    c.model.weights = "random"
    c.model.tokenizer = "smollm2_gguf"
  c.model.lora_rank = a.lora_rank
  c.model.lora_alpha = 2.0 * a.lora_rank if a.lora_rank else 16.0
  c.data.name = a.data
  c.data.seq_len = a.seq_len
  c.data.batch_size = a.batch_size
  c.data.num_epochs = None          # repeat; the run length is train.steps
  c.data.eval_fraction = 0.02       # held-out slice of the train file for eval loss
  c.optim.lr = 2e-4 if a.lora_rank else 5e-5
  c.optim.warmup_steps = 5
  c.optim.schedule = "cosine"
  c.optim.clip_norm = 1.0
  c.train.steps = a.steps
  c.train.log_every = 1
  c.train.eval_every = max(a.steps // 3, 1)
  c.train.eval_batches = 2
  c.train.checkpoint_every = max(a.steps // 2, 1)
  c.train.keep = 2
  return c
