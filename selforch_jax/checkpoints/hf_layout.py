"""The one mapping between Hugging Face Llama/Qwen3 tensors and our parameter tree.

Every weight source goes through this module: HF safetensors directly
(:mod:`selforch_jax.checkpoints.safetensors_io`) and GGUF files after their
llama.cpp-specific renaming and q/k un-permutation
(:mod:`selforch_jax.checkpoints.gguf_import`).

HF (PyTorch ``nn.Linear``) stores a projection as ``weight [out, in]`` and computes
``x @ weight.T``; we store ``[in, ...out]`` with attention heads split out and the
``L`` layers stacked on a leading axis (see
:class:`selforch_jax.models.transformer.DecoderLayers`):

==========================================================  ====================  ===================
HF name (``{i}`` = layer)                                    HF shape              ours (``layers.*`` stacked on L)
==========================================================  ====================  ===================
``model.embed_tokens.weight``                                ``[V, D]``            ``embed [V, D]``
``model.layers.{i}.input_layernorm.weight``                  ``[D]``               ``attn_norm [L, D]``
``model.layers.{i}.self_attn.q_proj.weight``                 ``[H*Dh, D]``         ``q_proj [L, D, H, Dh]``
``model.layers.{i}.self_attn.k_proj.weight``                 ``[K*Dh, D]``         ``k_proj [L, D, K, Dh]``
``model.layers.{i}.self_attn.v_proj.weight``                 ``[K*Dh, D]``         ``v_proj [L, D, K, Dh]``
``model.layers.{i}.self_attn.o_proj.weight``                 ``[D, H*Dh]``         ``o_proj [L, H, Dh, D]``
``model.layers.{i}.self_attn.q_norm.weight`` (Qwen3)         ``[Dh]``              ``q_norm [L, Dh]``
``model.layers.{i}.self_attn.k_norm.weight`` (Qwen3)         ``[Dh]``              ``k_norm [L, Dh]``
``model.layers.{i}.post_attention_layernorm.weight``         ``[D]``               ``mlp_norm [L, D]``
``model.layers.{i}.mlp.gate_proj.weight``                    ``[F, D]``            ``gate_proj [L, D, F]``
``model.layers.{i}.mlp.up_proj.weight``                      ``[F, D]``            ``up_proj [L, D, F]``
``model.layers.{i}.mlp.down_proj.weight``                    ``[D, F]``            ``down_proj [L, F, D]``
``model.norm.weight``                                        ``[D]``               ``final_norm [D]``
``lm_head.weight`` (untied only)                             ``[V, D]``            ``lm_head [D, V]``
==========================================================  ====================  ===================
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from selforch_jax.models.config import ModelConfig

# Buffers some HF checkpoints carry that are not parameters (recomputed from the config).
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

# our stacked name -> (HF per-layer suffix, kind). kind says how to convert one layer.
_LAYER_MAP: dict[str, tuple[str, str]] = {
    "attn_norm": ("input_layernorm.weight", "vector"),
    "q_proj": ("self_attn.q_proj.weight", "qkv"),
    "k_proj": ("self_attn.k_proj.weight", "qkv"),
    "v_proj": ("self_attn.v_proj.weight", "qkv"),
    "o_proj": ("self_attn.o_proj.weight", "o"),
    "q_norm": ("self_attn.q_norm.weight", "vector"),
    "k_norm": ("self_attn.k_norm.weight", "vector"),
    "mlp_norm": ("post_attention_layernorm.weight", "vector"),
    "gate_proj": ("mlp.gate_proj.weight", "linear"),
    "up_proj": ("mlp.up_proj.weight", "linear"),
    "down_proj": ("mlp.down_proj.weight", "linear"),
}


def _layer_names(cfg: ModelConfig) -> list[str]:
  names = ["attn_norm", "q_proj", "k_proj", "v_proj", "o_proj"]
  if cfg.qk_norm:
    names += ["q_norm", "k_norm"]
  return names + ["mlp_norm", "gate_proj", "up_proj", "down_proj"]


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every HF tensor name a checkpoint of ``cfg`` must have, with its HF shape ``[out, in]``.

  ``lm_head.weight`` is listed only when ``cfg.tie_word_embeddings`` is False.
  """
  V, D, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
  H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  per_layer = {
      "attn_norm": (D,), "q_proj": (H * Dh, D), "k_proj": (K * Dh, D), "v_proj": (K * Dh, D),
      "o_proj": (D, H * Dh), "q_norm": (Dh,), "k_norm": (Dh,), "mlp_norm": (D,),
      "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F),
  }
  out = {"model.embed_tokens.weight": (V, D)}
  for i in range(cfg.num_layers):
    for name in _layer_names(cfg):
      out[f"model.layers.{i}.{_LAYER_MAP[name][0]}"] = per_layer[name]
  out["model.norm.weight"] = (D,)
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = (V, D)
  return out


def _our_layer_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
  D, F, H, K, Dh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                    cfg.head_dim)
  return {
      "attn_norm": (D,), "q_proj": (D, H, Dh), "k_proj": (D, K, Dh), "v_proj": (D, K, Dh),
      "o_proj": (H, Dh, D), "q_norm": (Dh,), "k_norm": (Dh,), "mlp_norm": (D,),
      "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D),
  }[name]


def _to_ours(cfg: ModelConfig, name: str, w: np.ndarray) -> np.ndarray:
  """One layer's HF tensor -> our per-layer layout (a view where possible)."""
  kind = _LAYER_MAP[name][1]
  if kind == "vector":
    return w
  if kind == "linear":
    return w.T
  if kind == "qkv":  # [n*Dh, D] -> [D, n, Dh]
    return w.T.reshape(_our_layer_shape(cfg, name))
  if kind == "o":  # [D, H*Dh] -> [H, Dh, D]
    return w.T.reshape(_our_layer_shape(cfg, name))
  raise AssertionError(kind)


def _to_hf(name: str, w: np.ndarray) -> np.ndarray:
  """One layer of ours -> HF layout ``[out, in]`` (contiguous)."""
  kind = _LAYER_MAP[name][1]
  if kind == "vector":
    out = w
  elif kind == "linear":
    out = w.T
  elif kind == "qkv":  # [D, n, Dh] -> [n*Dh, D]
    out = w.reshape(w.shape[0], -1).T
  else:  # o: [H, Dh, D] -> [D, H*Dh]
    out = w.reshape(-1, w.shape[-1]).T
  return np.ascontiguousarray(out)


def check_hf_tensors(cfg: ModelConfig, tensors: Mapping[str, Any]) -> None:
  """Validate names and shapes of an HF state dict against ``cfg``.

  Tensors need only ``.shape`` here. ``lm_head.weight`` is tolerated in a tied
  checkpoint (PyTorch ``state_dict()`` lists it); rotary ``inv_freq`` buffers are
  ignored.

  Raises:
    ValueError: listing missing tensors, unexpected tensors, or the first shape
      mismatch (naming the tensor, its shape and the expected shape).
  """
  expected = hf_shapes(cfg)
  present = set(tensors)
  missing = [k for k in expected if k not in present]
  allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
  unexpected = sorted(k for k in present
                      if k not in expected and k not in allowed_extra and not _IGNORED.match(k))
  problems = []
  if missing:
    problems.append(f"{len(missing)} missing tensor(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  if unexpected:
    problems.append(f"{len(unexpected)} unexpected tensor(s): {unexpected[:8]}"
                    f"{' ...' if len(unexpected) > 8 else ''}")
  if problems:
    raise ValueError(f"checkpoint does not match the {cfg.arch} config "
                     f"(L={cfg.num_layers}, D={cfg.hidden_size}, V={cfg.vocab_size}): "
                     + "; ".join(problems))
  for k, shape in expected.items():
    got = tuple(tensors[k].shape)
    if got != shape:
      raise ValueError(f"tensor {k!r} has shape {got}, expected {shape} for the config "
                       f"(H={cfg.num_heads}, K={cfg.num_kv_heads}, Dh={cfg.head_dim}, "
                       f"D={cfg.hidden_size}, F={cfg.intermediate_size}, V={cfg.vocab_size})")
  if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
    got = tuple(tensors["lm_head.weight"].shape)
    if got != expected["model.embed_tokens.weight"]:
      raise ValueError(f"tensor 'lm_head.weight' has shape {got}, expected "
                       f"{expected['model.embed_tokens.weight']} (tied embeddings)")


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """Convert an HF Llama/Qwen3 state dict to our nested parameter dict.

  Args:
    cfg: the model config (shapes, ``qk_norm``, ``tie_word_embeddings``).
    tensors: HF name -> array in HF layout (``[out, in]`` for projections); numpy
      arrays or anything ``np.asarray`` accepts (e.g. CPU torch tensors converted by
      the caller). Any float dtype; the result keeps it.

  Returns:
    Nested dict with the structure of ``param_dict(Transformer(cfg))``: ``embed``,
    ``layers`` (stacked on a leading ``L`` axis, heads split), ``final_norm`` and,
    untied, ``lm_head``; values are numpy arrays.

  Raises:
    ValueError: missing / unexpected tensors or shape mismatches (see
      :func:`check_hf_tensors`), or a tied config whose ``lm_head.weight`` differs
      from the embedding.
  """
  check_hf_tensors(cfg, tensors)
  t = {k: np.asarray(v) for k, v in tensors.items()}
  embed = t["model.embed_tokens.weight"]
  if cfg.tie_word_embeddings and "lm_head.weight" in t and not np.array_equal(
      t["lm_head.weight"], embed):
    raise ValueError("config has tie_word_embeddings=True but 'lm_head.weight' differs from "
                     "'model.embed_tokens.weight'; load with tie_word_embeddings=False")
  layers = {}
  for name in _layer_names(cfg):
    suffix = _LAYER_MAP[name][0]
    layers[name] = np.stack([_to_ours(cfg, name, t[f"model.layers.{i}.{suffix}"])
                             for i in range(cfg.num_layers)])
  out: dict[str, Any] = {"embed": embed, "layers": layers, "final_norm": t["model.norm.weight"]}
  if not cfg.tie_word_embeddings:
    out["lm_head"] = np.ascontiguousarray(t["lm_head.weight"].T)
  return out


def hf_from_params(cfg: ModelConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Inverse of :func:`params_from_hf`: our nested dict -> HF state dict.

  Args:
    cfg: the model config.
    params: nested dict as returned by ``param_dict(model)`` (jax or numpy arrays).
      LoRA adapters (``*_lora_a`` / ``*_lora_b``), if any, are merged into the base
      weights (``models.transformer.merge_lora``), since HF checkpoints have none.

  Returns:
    HF name -> contiguous numpy array in HF layout, dtype unchanged. Tied configs
    get no ``lm_head.weight`` (as ``save_pretrained`` writes them).

  Raises:
    ValueError: if ``params`` does not have the structure/shapes of ``cfg``.
  """
  layers = params["layers"]
  if any(_is_lora(k) for k in layers):  # fold adapters into the base weights first
    if not cfg.lora_rank:
      raise ValueError("params contain LoRA adapters but cfg.lora_rank == 0; pass the config "
                       "the adapters were trained with (it gives their scale alpha / r)")
    from selforch_jax.models.transformer import merge_lora
    layers = merge_lora(dict(layers), cfg)
    params = {**params, "layers": layers}
  _check_params(cfg, params)
  out = {"model.embed_tokens.weight": np.ascontiguousarray(np.asarray(params["embed"]))}
  stacked = {name: np.asarray(layers[name]) for name in _layer_names(cfg)}
  for i in range(cfg.num_layers):
    for name in _layer_names(cfg):
      out[f"model.layers.{i}.{_LAYER_MAP[name][0]}"] = _to_hf(name, stacked[name][i])
  out["model.norm.weight"] = np.ascontiguousarray(np.asarray(params["final_norm"]))
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
  return out


def expected_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
  """Nested dict of our parameter shapes for ``cfg`` (same structure as ``param_dict``)."""
  L = cfg.num_layers
  out: dict[str, Any] = {
      "embed": (cfg.vocab_size, cfg.hidden_size),
      "layers": {n: (L, *_our_layer_shape(cfg, n)) for n in _layer_names(cfg)},
      "final_norm": (cfg.hidden_size,),
  }
  if not cfg.tie_word_embeddings:
    out["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
  return out


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(_flatten(v, key + "."))
    else:
      out[key] = v
  return out


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, v in flat.items():
    *parents, leaf = key.split(".")
    d = out
    for p in parents:
      d = d.setdefault(p, {})
    d[leaf] = v
  return out


def _is_lora(key: str) -> bool:
  return "_lora_" in key


def _is_view(key: str, cfg: ModelConfig) -> bool:
  """An extra attention view's parameter (``layers.<name>_<view>``, ``cfg.attn_views``)."""
  return any(key.endswith(f"_{v}") for v in cfg.attn_views)


def _check_params(cfg: ModelConfig, params: Mapping[str, Any]) -> None:
  """Base parameters must match ``cfg`` exactly; LoRA adapter and attention-view entries are
  not checked here (they must exist in the model: :func:`load_params_into`)."""
  expected = _flatten(expected_param_shapes(cfg))
  got = {k: v for k, v in _flatten(params).items() if not _is_lora(k) and not _is_view(k, cfg)}
  missing = sorted(set(expected) - set(got))
  unexpected = sorted(set(got) - set(expected))
  if missing or unexpected:
    raise ValueError(f"parameter tree does not match the {cfg.arch} config: "
                     f"missing {missing}, unexpected {unexpected}")
  for k, shape in expected.items():
    if tuple(np.shape(got[k])) != shape:
      raise ValueError(f"parameter {k!r} has shape {tuple(np.shape(got[k]))}, expected {shape}")


def load_params_into(model: nnx.Module, params: Mapping[str, Any]) -> nnx.Module:
  """Write ``params`` into ``model`` in place (also works on an ``nnx.eval_shape`` model).

  Args:
    model: a :class:`~selforch_jax.models.transformer.Transformer` (its ``cfg``
      gives the expected shapes and ``param_dtype``).
    params: nested dict as from :func:`params_from_hf`; values are cast to
      ``cfg.param_dtype``. LoRA adapters of ``model`` (``cfg.lora_rank > 0``) that
      ``params`` does not mention keep their current values.

  Returns:
    ``model`` (for chaining).

  Raises:
    ValueError: naming missing / unexpected parameters or the first shape mismatch.
  """
  cfg: ModelConfig = model.cfg
  _check_params(cfg, params)
  pd = cfg.jnp_param_dtype
  state = nnx.state(model, nnx.Param)
  current = _flatten(nnx.to_pure_dict(state))
  new = _flatten(params)
  unexpected = sorted(set(new) - set(current))
  if unexpected:
    raise ValueError(f"parameters {unexpected} do not exist in the model")
  for k, v in new.items():
    if tuple(np.shape(v)) != tuple(current[k].shape):
      raise ValueError(f"parameter {k!r} has shape {tuple(np.shape(v))}, "
                       f"the model expects {tuple(current[k].shape)}")
  merged = {k: jnp.asarray(new[k], dtype=pd) if k in new else current[k] for k in current}
  nnx.replace_by_pure_dict(state, _unflatten(merged))
  nnx.update(model, state)
  return model


def model_from_params(cfg: ModelConfig, params: Mapping[str, Any]):
  """Build a :class:`Transformer` holding ``params`` without a random initialisation.

  The module is created abstractly (``nnx.eval_shape``), so loading a checkpoint costs
  only the copies into device arrays. With ``cfg.lora_rank > 0`` and no adapters in
  ``params``, the model is initialised for real (fresh adapters, ``B = 0``) first.

  Raises:
    ValueError: as :func:`load_params_into`.
  """
  from selforch_jax.models.transformer import Transformer  # local: avoid import cycles

  has_lora = any(_is_lora(k) for k in _flatten(params))
  if cfg.lora_rank and not has_lora:
    model = Transformer(cfg, rngs=nnx.Rngs(params=0))
  else:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
  return load_params_into(model, params)
