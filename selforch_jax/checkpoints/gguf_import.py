"""Import llama-architecture GGUF files (llama.cpp's format) into our Transformer.

Pipeline: read the file with ``gguf.GGUFReader`` (memory-mapped) -> config from the
``llama.*`` metadata -> dequantize every tensor to float32 ``[out, in]`` with
``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants,
... whatever the installed ``gguf`` supports) -> rename llama.cpp tensor names to HF
names -> undo llama.cpp's q/k row permutation -> the one HF mapping
(:mod:`selforch_jax.checkpoints.hf_layout`).

The q/k permutation: llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``)
reorders the rows of ``q_proj`` / ``k_proj`` of every head from HF's "rotate half"
RoPE layout (pairs ``(i, i + Dh/2)``) to the interleaved layout llama.cpp rotates
(pairs ``(2i, 2i + 1)``). :func:`unpermute_qk` is its inverse, so the imported
weights use the HF convention that :mod:`selforch_jax.models.rope` implements.
Transformers' GGUF loader (``LlamaTensorProcessor._reverse_permute_weights``) does
the same.
"""

from __future__ import annotations

import os
import re
import struct
from typing import Any, Mapping

import numpy as np

from selforch_jax.checkpoints.hf_layout import check_hf_tensors, model_from_params, params_from_hf
from selforch_jax.models.config import ModelConfig, RopeScaling

SUPPORTED_GGUF_ARCHS = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")
# Tensors that carry configuration, not parameters.
_CONFIG_TENSORS = ("rope_freqs.weight",)


def gguf_to_hf_name(name: str) -> str | None:
  """llama.cpp tensor name -> HF name (``blk.3.attn_q.weight`` ->
  ``model.layers.3.self_attn.q_proj.weight``); None for names we do not know."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  m = _BLOCK_RE.match(name)
  if m and m.group(2) in _BLOCK_NAMES:
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"
  return None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``, ``LlamaModel.permute``).

  ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)``.
  Pass ``n_head = num_heads`` for ``q_proj`` and ``n_head = num_kv_heads`` for ``k_proj``.

  Args:
    w: ``[n_head * Dh, ...]`` HF-layout weight (rows are outputs).
    n_head: number of heads in the rows.

  Returns:
    Array of the same shape and dtype, rows in llama.cpp's interleaved-RoPE order.
  """
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of :func:`permute_qk`: llama.cpp row order -> HF "rotate half" order.

  Args:
    w: ``[n_head * Dh, ...]`` weight as stored in a GGUF file (dequantized, ``[out, in]``).
    n_head: ``num_heads`` for ``attn_q``, ``num_kv_heads`` for ``attn_k``.

  Returns:
    Array of the same shape and dtype (a copy).
  """
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def open_gguf(path: str | os.PathLike):
  """Open a GGUF file (memory-mapped ``gguf.GGUFReader``).

  Raises:
    FileNotFoundError: ``path`` does not exist (the message names it).
    ValueError: ``"<path> is not a valid/complete GGUF file: <reason>"`` for a
      truncated or corrupt file (whatever ``gguf`` raised is chained).
  """
  import gguf

  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file {path!r} does not exist")
  if os.path.isdir(path):
    raise IsADirectoryError(f"GGUF path {path!r} is a directory, not a file")
  try:
    return gguf.GGUFReader(path)
  except (ValueError, IndexError, KeyError, OverflowError, TypeError, struct.error,
          UnicodeDecodeError, EOFError) as e:
    raise ValueError(f"{path!r} is not a valid/complete GGUF file: "
                     f"{type(e).__name__}: {e}") from e


def read_metadata(reader) -> dict[str, Any]:
  """All key/value fields of a GGUF file as plain Python values (str, int, float, lists).

  Includes the tokenizer (``tokenizer.ggml.tokens``, ``...merges``, ``...token_type``,
  special token ids, ``tokenizer.chat_template``) and the ``GGUF.*`` header fields.
  """
  return {name: field.contents() for name, field in reader.fields.items()}


def _clean_float(x: float) -> float:
  """float32 metadata value -> the shortest decimal that round-trips (9.99999974e-06 -> 1e-05)."""
  return float(str(np.float32(x)))


def dequantize_tensor(reader_tensor) -> np.ndarray:
  """Dequantize one tensor of a ``gguf.GGUFReader``.

  Args:
    reader_tensor: a ``gguf.gguf_reader.ReaderTensor`` (``.name``, ``.tensor_type``,
      ``.shape`` in GGUF ``ne`` order, i.e. innermost first, ``.data`` memory-mapped).

  Returns:
    float32 numpy array in PyTorch order, i.e. the reverse of ``ne``: ``[out, in]``
    for a matrix (``[rows, cols]`` of ``ggml``), ``[n]`` for a vector. Values equal
    ``gguf.quants.dequantize(t.data, t.tensor_type)`` bit for bit (F64 is cast).

  Raises:
    ValueError: naming the tensor and its type, for integer tensors or quantization
      types the installed ``gguf`` cannot dequantize.
  """
  import gguf
  from gguf import GGMLQuantizationType as Q

  t = reader_tensor
  qtype = t.tensor_type
  if qtype in (Q.I8, Q.I16, Q.I32, Q.I64):
    raise ValueError(f"GGUF tensor {t.name!r} has integer type {qtype.name}; expected a float "
                     "or quantized weight")
  if qtype == Q.F64:
    arr = np.asarray(t.data, np.float32)
  else:
    try:
      arr = gguf.quants.dequantize(t.data, qtype)
    except NotImplementedError as e:
      raise ValueError(f"GGUF tensor {t.name!r} has type {qtype.name}, which gguf "
                       f"{getattr(gguf, '__version__', '')} cannot dequantize") from e
  shape = tuple(int(n) for n in reversed(list(t.shape)))
  if arr.size != int(np.prod(shape)):
    raise ValueError(f"GGUF tensor {t.name!r} ({qtype.name}) dequantized to {arr.size} values, "
                     f"expected shape {shape}")
  return np.asarray(arr, np.float32).reshape(shape)


def _llama3_scaling_from_freq_factors(factors: np.ndarray, cfg: ModelConfig,
                                      orig_ctx: int) -> RopeScaling | None:
  """Recover Llama-3 RoPE scaling parameters from llama.cpp's ``rope_freqs`` tensor.

  llama.cpp's converter (``LlamaModel.generate_extra_tensors``) stores, per frequency,
  the divisor ``f_i`` (1 for short wavelengths, ``factor`` for long ones, and
  ``1 / ((1 - s)/factor + s)`` with ``s = (orig/wavelen - low)/(high - low)`` in between)
  instead of the four parameters. ``s`` is affine in ``1/wavelen`` so two in-between
  frequencies determine ``low`` / ``high`` for a given ``orig`` (any common scaling of
  ``orig, low, high`` gives the same frequencies). Verified by recomputing the frequencies.

  Raises:
    ValueError: if the factors are not of that form (e.g. LongRoPE).
  """
  f = np.asarray(factors, np.float64).reshape(-1)
  dh = cfg.head_dim
  if f.shape != (dh // 2,):
    raise ValueError(f"rope_freqs has {f.size} entries, expected head_dim/2 = {dh // 2}")
  if np.allclose(f, 1.0, rtol=0, atol=1e-6):
    return None
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
  wavelen = 2 * np.pi / inv
  factor = float(f.max())
  tol = 1e-5 * factor
  mid = (f > 1 + tol) & (f < factor - tol)
  candidates = []
  if mid.sum() >= 2:
    s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    x = orig_ctx / wavelen[mid]
    slope, intercept = np.polyfit(x, s, 1)
    if slope > 0:
      low = -intercept / slope
      candidates.append((low, low + 1 / slope))
  candidates.append((1.0, 4.0))  # Llama 3.x defaults
  expected = (inv / f).astype(np.float32)
  from selforch_jax.models.rope import rope_inv_freq
  for low, high in candidates:
    rs = RopeScaling(factor=_clean_float(factor), low_freq_factor=float(low),
                     high_freq_factor=float(high), original_max_position_embeddings=int(orig_ctx))
    got = rope_inv_freq(cfg.replace(rope_scaling=rs))
    if np.allclose(got, expected, rtol=2e-5, atol=0):
      return rs
  raise ValueError("the GGUF rope_freqs tensor is not a Llama-3 frequency scaling "
                   f"(factors {np.round(f, 4).tolist()}); only llama3 RoPE scaling is supported")


def config_from_gguf(metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]],
                     *, param_dtype: str = "float32", dtype: str | None = None,
                     rope_freqs: np.ndarray | None = None) -> ModelConfig:
  """Build a :class:`ModelConfig` from llama-architecture GGUF metadata.

  Keys read (``llama.`` prefix): ``block_count``, ``embedding_length``,
  ``feed_forward_length``, ``attention.head_count``, ``attention.head_count_kv``,
  ``attention.key_length`` (else ``embedding_length / head_count``),
  ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``, ``rope.dimension_count``
  (must equal the head dim), ``context_length``, ``vocab_size`` (else the embedding
  rows), ``rope.scaling.type`` / ``.factor`` / ``.original_context_length``. Tied
  embeddings iff there is no ``output.weight`` tensor. Llama-3 RoPE scaling is
  recovered from the ``rope_freqs`` tensor when given.

  Args:
    metadata: from :func:`read_metadata`.
    tensor_shapes: GGUF tensor name -> shape in PyTorch order (``[out, in]``).
    param_dtype, dtype: storage / compute dtypes (``dtype`` defaults to ``param_dtype``).
    rope_freqs: the dequantized ``rope_freqs.weight`` tensor, if the file has one.

  Raises:
    ValueError: unsupported architecture (named), missing required keys, partial
      rotary, or RoPE scaling types other than none/llama3.
  """
  arch = metadata.get("general.architecture")
  if arch not in SUPPORTED_GGUF_ARCHS:
    raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_GGUF_ARCHS}")

  def get(key, default=None, required=False):
    full = f"{arch}.{key}"
    if full not in metadata:
      if required:
        raise ValueError(f"GGUF metadata lacks required key {full!r}")
      return default
    return metadata[full]

  hidden = int(get("embedding_length", required=True))
  n_head = int(get("attention.head_count", required=True))
  n_kv = get("attention.head_count_kv", n_head)
  if isinstance(n_kv, list):
    if len(set(n_kv)) != 1:
      raise ValueError(f"per-layer head_count_kv {n_kv} is not supported")
    n_kv = n_kv[0]
  head_dim = int(get("attention.key_length", hidden // n_head))
  rot = get("rope.dimension_count")
  if rot is not None and int(rot) != head_dim:
    raise ValueError(f"partial rotary (rope.dimension_count={rot} != head_dim={head_dim}) "
                     "is not supported")
  if "token_embd.weight" not in tensor_shapes:
    raise ValueError("GGUF file has no token_embd.weight tensor")
  vocab = int(get("vocab_size", tensor_shapes["token_embd.weight"][0]))
  theta = _clean_float(get("rope.freq_base", 10000.0))
  cfg = ModelConfig(
      arch="llama",
      vocab_size=vocab,
      hidden_size=hidden,
      intermediate_size=int(get("feed_forward_length", required=True)),
      num_layers=int(get("block_count", required=True)),
      num_heads=n_head,
      num_kv_heads=int(n_kv),
      head_dim=head_dim,
      rms_norm_eps=_clean_float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      rope_theta=theta,
      tie_word_embeddings="output.weight" not in tensor_shapes,
      max_position_embeddings=int(get("context_length", 2048)),
      param_dtype=param_dtype,
      dtype=dtype or param_dtype,
  )
  stype = get("rope.scaling.type")
  sfactor = get("rope.scaling.factor")
  if stype not in (None, "none", "") and not (stype == "linear" and sfactor in (None, 1.0)):
    raise ValueError(f"RoPE scaling type {stype!r} (factor {sfactor}) is not supported; "
                     "only llama3 scaling (rope_freqs tensor) is")
  if rope_freqs is not None:
    orig = int(get("rope.scaling.original_context_length", 8192))  # llama.cpp's default
    cfg = cfg.replace(rope_scaling=_llama3_scaling_from_freq_factors(rope_freqs, cfg, orig))
  return cfg


def hf_tensors_from_gguf(reader, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Dequantize every weight of ``reader`` into an HF state dict (float32, ``[out, in]``).

  Renames with :func:`gguf_to_hf_name` and applies :func:`unpermute_qk` to
  ``attn_q`` (``num_heads``) and ``attn_k`` (``num_kv_heads``).

  Raises:
    ValueError: unknown tensor names, or (before any dequantization) missing
      tensors / shape mismatches naming the tensor and both shapes.
  """
  by_hf = {}
  unknown = []
  for t in reader.tensors:
    if t.name in _CONFIG_TENSORS:
      continue
    hf = gguf_to_hf_name(t.name)
    if hf is None:
      unknown.append(t.name)
    else:
      by_hf[hf] = t
  if unknown:
    raise ValueError(f"GGUF file has tensors a {cfg.arch} model does not use: {unknown[:8]}"
                     f"{' ...' if len(unknown) > 8 else ''}")

  class _Shape:  # shape-only stand-in so names/shapes are checked before dequantizing
    def __init__(self, t):
      self.shape = tuple(int(n) for n in reversed(list(t.shape)))

  check_hf_tensors(cfg, {k: _Shape(t) for k, t in by_hf.items()})
  out = {}
  for hf, t in by_hf.items():
    w = dequantize_tensor(t)
    if hf.endswith("self_attn.q_proj.weight"):
      w = unpermute_qk(w, cfg.num_heads)
    elif hf.endswith("self_attn.k_proj.weight"):
      w = unpermute_qk(w, cfg.num_kv_heads)
    out[hf] = w
  return out


def load_gguf(path: str | os.PathLike, *, param_dtype: str = "float32",
              dtype: str | None = None):
  """Load a llama-architecture GGUF file as ``(cfg, model, metadata)``.

  Args:
    path: the ``.gguf`` file (e.g. ``selforch_jax.checkpoints.assets.smollm2_gguf_path()``).
    param_dtype: storage dtype of the parameters (``"float32"`` / ``"bfloat16"`` /
      ``"float16"``); weights are dequantized to float32 first, then cast.
    dtype: compute dtype; defaults to ``param_dtype``.

  Returns:
    ``cfg``: :class:`ModelConfig` from the metadata (see :func:`config_from_gguf`);
    ``model``: :class:`~selforch_jax.models.transformer.Transformer` with the weights;
    ``metadata``: every GGUF key/value (:func:`read_metadata`), including the tokenizer.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: the file is truncated/corrupt ("... is not a valid/complete GGUF
      file"), the architecture is not llama (named), a tensor type cannot be
      dequantized (tensor and type named), or tensors are missing / unexpected /
      mis-shaped (named, with both shapes).
  """
  reader = open_gguf(path)
  metadata = read_metadata(reader)
  shapes = {t.name: tuple(int(n) for n in reversed(list(t.shape))) for t in reader.tensors}
  rope_freqs = None
  for t in reader.tensors:
    if t.name == "rope_freqs.weight":
      rope_freqs = dequantize_tensor(t)
  cfg = config_from_gguf(metadata, shapes, param_dtype=param_dtype, dtype=dtype,
                         rope_freqs=rope_freqs)
  tensors = hf_tensors_from_gguf(reader, cfg)
  params = params_from_hf(cfg, tensors)
  del tensors
  return cfg, model_from_params(cfg, params), metadata
