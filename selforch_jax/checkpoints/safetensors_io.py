"""Hugging Face checkpoint directories (``config.json`` + safetensors) in and out.

A directory written by :func:`export_hf` loads with
``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` (tested for parity);
:func:`import_hf` reads such directories, including sharded ones with
``model.safetensors.index.json`` as ``save_pretrained`` writes for large models.
Tensor names and layouts are converted by :mod:`selforch_jax.checkpoints.hf_layout`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from selforch_jax.checkpoints.hf_layout import hf_from_params, model_from_params, params_from_hf
from selforch_jax.models.config import ModelConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
GENERATION_CONFIG_NAME = "generation_config.json"

_NP_DTYPES = {"float32": np.float32, "float16": np.float16}


def _np_dtype(name: str):
  if name == "bfloat16":
    import ml_dtypes  # a jax dependency
    return ml_dtypes.bfloat16
  if name not in _NP_DTYPES:
    raise ValueError(f"export dtype {name!r} is not one of ['bfloat16', 'float16', 'float32']")
  return _NP_DTYPES[name]


def _as_id(val: Any) -> int | None:
  return int(val) if isinstance(val, (int, np.integer)) and not isinstance(val, bool) else None


def special_ids_for_hf(tokenizer: Any) -> dict[str, int | list[int]]:
  """The ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` entries of an HF config.

  Reads our :class:`~selforch_jax.tokenizers.Tokenizer` names (``bos_id``, ``eos_id``,
  ``pad_id``, ``stop_ids``) and, failing those, HF's (``bos_token_id``, ...). The EOS entry
  holds every stop id (EOS first, then e.g. ``<|im_end|>``): one id as an int, several as a
  list (``transformers`` accepts both and stops at any of them).

  Args:
    tokenizer: a tokenizer, or ``None``.

  Returns:
    dict: only the keys whose ids are known (empty for ``None``).
  """
  if tokenizer is None:
    return {}
  out: dict[str, int | list[int]] = {}
  for key, ours in (("bos_token_id", "bos_id"), ("pad_token_id", "pad_id")):
    val = _as_id(getattr(tokenizer, ours, None))
    val = _as_id(getattr(tokenizer, key, None)) if val is None else val
    if val is not None:
      out[key] = val
  eos: list[int] = []
  for val in (getattr(tokenizer, "eos_id", None), getattr(tokenizer, "eos_token_id", None),
              *(getattr(tokenizer, "stop_ids", None) or ())):
    val = _as_id(val)
    if val is not None and val not in eos:
      eos.append(val)
  if eos:
    out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
  return out


def export_hf(model, cfg: ModelConfig, out_dir: str | os.PathLike, tokenizer: Any = None,
              dtype: str = "float32") -> str:
  """Write ``model`` as a Hugging Face checkpoint directory.

  Files: ``config.json`` (``cfg.to_hf_dict()`` with ``torch_dtype = dtype``),
  ``model.safetensors`` (HF names and ``[out, in]`` layouts, metadata
  ``{"format": "pt"}``; tied models have no ``lm_head.weight``),
  ``generation_config.json`` (``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` from
  the tokenizer, see :func:`special_ids_for_hf`; ``eos_token_id`` lists every stop id, so
  ``transformers`` stops at EOS and at the chat template's end-of-turn token) and, when
  ``tokenizer`` has a ``save_hf(dir)`` method, whatever it writes (``tokenizer.json`` etc.).

  Args:
    model: a :class:`~selforch_jax.models.transformer.Transformer`.
    cfg: its config.
    out_dir: directory (created if needed; existing files are overwritten).
    tokenizer: optional tokenizer object with ``save_hf(dir)``.
    dtype: storage dtype of the tensors: ``"float32"``, ``"bfloat16"`` or ``"float16"``.

  Returns:
    ``out_dir`` as a string.

  Raises:
    ValueError: unknown ``dtype`` or parameters that do not match ``cfg``.
  """
  from safetensors.numpy import save_file

  from selforch_jax.models.transformer import param_dict

  np_dtype = _np_dtype(dtype)
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  tensors = hf_from_params(cfg, param_dict(model))
  tensors = {k: np.ascontiguousarray(np.asarray(v).astype(np_dtype, copy=False))
             for k, v in tensors.items()}
  weights = os.path.join(out_dir, WEIGHTS_NAME)
  save_file(tensors, weights, metadata={"format": "pt"})
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(weights, 0o666 & ~umask)  # safetensors writes 0600; readable like the other files
  hf_cfg = cfg.to_hf_dict()
  hf_cfg["torch_dtype"] = dtype
  gen: dict[str, Any] = {"_from_model_config": True}
  for key, val in special_ids_for_hf(tokenizer).items():
    hf_cfg[key] = gen[key] = val
  with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
    json.dump(hf_cfg, f, indent=2, sort_keys=True)
  with open(os.path.join(out_dir, GENERATION_CONFIG_NAME), "w") as f:
    json.dump(gen, f, indent=2, sort_keys=True)
  if tokenizer is not None and hasattr(tokenizer, "save_hf"):
    tokenizer.save_hf(out_dir)
  return out_dir


def read_hf_tensors(ckpt_dir: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of an HF checkpoint directory as numpy arrays (memory-mapped).

  Reads ``model.safetensors`` or, when absent, every shard listed in
  ``model.safetensors.index.json`` (``weight_map``).

  Raises:
    FileNotFoundError: neither file exists (names the directory), or a listed shard is missing.
    ValueError: the index lists a tensor that its shard does not contain.
  """
  from safetensors.numpy import load_file

  ckpt_dir = os.fspath(ckpt_dir)
  single = os.path.join(ckpt_dir, WEIGHTS_NAME)
  index = os.path.join(ckpt_dir, INDEX_NAME)
  if os.path.exists(single):
    return load_file(single)
  if not os.path.exists(index):
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {ckpt_dir!r}")
  with open(index) as f:
    weight_map: dict[str, str] = json.load(f)["weight_map"]
  out: dict[str, np.ndarray] = {}
  for shard in sorted(set(weight_map.values())):
    path = os.path.join(ckpt_dir, shard)
    if not os.path.exists(path):
      raise FileNotFoundError(f"shard {shard!r} listed in {index!r} does not exist")
    out.update(load_file(path))
  absent = sorted(k for k in weight_map if k not in out)
  if absent:
    raise ValueError(f"{INDEX_NAME} lists tensors absent from their shards: {absent[:8]}")
  return out


def import_hf(ckpt_dir: str | os.PathLike, param_dtype: str = "float32",
              dtype: str | None = None):
  """Load a Hugging Face Llama / Qwen3 checkpoint directory.

  Args:
    ckpt_dir: directory with ``config.json`` and ``model.safetensors`` (or a
      sharded ``model.safetensors.index.json``), as written by ``save_pretrained``
      or :func:`export_hf`.
    param_dtype: parameter storage dtype (``"float32"`` / ``"bfloat16"`` / ``"float16"``).
    dtype: compute dtype; defaults to ``param_dtype``.

  Returns:
    ``(cfg, model)``: the :class:`ModelConfig` and a
    :class:`~selforch_jax.models.transformer.Transformer` holding the weights.

  Raises:
    FileNotFoundError: missing directory, ``config.json`` or weights.
    ValueError: unsupported ``model_type`` (named) or features (from
      :meth:`ModelConfig.from_hf_dict`), missing / unexpected tensors or shape
      mismatches (from :func:`~selforch_jax.checkpoints.hf_layout.params_from_hf`).
  """
  ckpt_dir = os.fspath(ckpt_dir)
  cfg_path = os.path.join(ckpt_dir, CONFIG_NAME)
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(f"checkpoint directory {ckpt_dir!r} does not exist")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"no {CONFIG_NAME} in {ckpt_dir!r}")
  with open(cfg_path) as f:
    hf_cfg = json.load(f)
  cfg = ModelConfig.from_hf_dict(hf_cfg, param_dtype=param_dtype, dtype=dtype or param_dtype)
  tensors = read_hf_tensors(ckpt_dir)
  params = params_from_hf(cfg, tensors)
  return cfg, model_from_params(cfg, params)
