"""Model configuration for the decoder-only zoo (Llama 2/3, SmolLM2, Qwen3).

The field names follow the Hugging Face ``config.json`` of the Llama / Qwen3
families so that import and export are a rename, not a translation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SUPPORTED_ARCHS = ("llama", "qwen3")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYER_LOOPS = ("auto", "scan", "unroll")
# what ``layer_loop="auto"`` runs per backend, for decode steps (a forward with a KV cache) and
# for training forwards (no cache). CPU decode: unroll over per-layer weight arrays, measured 1.37x
# the scan's tokens/s on SmolLM2-135M on a quiet 2-core machine (29.1 vs 21.2 tokens/s, tokens
# identical; compile 8.2 s vs 1.4 s for every program of a warm-up;
# bench/results/decode_throughput_cpu.json ``layer_loop``); CPU training: scan (one layer to
# compile and differentiate). GPU/TPU: scan (not measured unrolled).
AUTO_LAYER_LOOP = {("cpu", True): "unroll", ("cpu", False): "scan"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style RoPE frequency scaling (``rope_type == "llama3"``).

  Follows Meta's Llama 3.1 reference ``apply_scaling`` (also HF
  ``_compute_llama3_parameters``): wavelengths longer than
  ``original_max_position_embeddings / low_freq_factor`` are divided by
  ``factor``, shorter than ``... / high_freq_factor`` are kept, and the band in
  between is interpolated smoothly.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  rope_type: str = "llama3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only transformer.

  Attributes:
    arch: ``"llama"`` (Llama 2/3, SmolLM2) or ``"qwen3"`` (adds per-head q/k RMSNorm).
    vocab_size: number of embedding rows V.
    hidden_size: model width D.
    intermediate_size: SwiGLU width F.
    num_layers: number of decoder layers L (scanned).
    num_heads: query heads H.
    num_kv_heads: key/value heads (GQA); must divide ``num_heads``.
    head_dim: per-head width; defaults to ``hidden_size // num_heads``.
    rms_norm_eps: epsilon of every RMSNorm.
    rope_theta: RoPE base.
    rope_scaling: optional Llama-3 frequency scaling.
    tie_word_embeddings: whether the LM head reuses the embedding matrix.
    max_position_embeddings: the context length the model was trained for.
    param_dtype: storage dtype of parameters (``"float32"`` or ``"bfloat16"``).
    dtype: compute dtype of matmuls (``"float32"`` or ``"bfloat16"``); softmax,
      norms and logits are always computed in float32.
    remat: rematerialise each layer in the backward pass (saves memory in training).
    lora_rank: rank r of LoRA adapters (Hu et al. 2021) on ``lora_targets``; 0 = none.
    lora_alpha: LoRA scale numerator; the update is ``(alpha / r) * x @ A @ B``.
    lora_targets: which projections get adapters (names of :class:`DecoderLayers` params).
    attn_views: names of extra attention views (e.g. Orthrus's ``"diffusion"``): each adds the
      per-layer parameters ``q_proj_<view>, k_proj_<view>, v_proj_<view>, o_proj_<view>`` (and
      ``q_norm_<view>, k_norm_<view>`` with ``qk_norm``); the forward with ``view=<name>`` uses
      them in every layer, everything else is shared (see
      :func:`selforch_jax.models.transformer.add_attn_view`). Names are identifiers, not
      ``"base"`` and without ``"lora"``.
    layer_loop: how the forward runs the L layers: ``"scan"`` (``jax.lax.scan`` over the stacked
      parameters: one layer compiled), ``"unroll"`` (a Python loop: L layers compiled; faster
      decode on CPU, where the scan copies each layer's weight slices) or ``"auto"``
      (:data:`AUTO_LAYER_LOOP` of the backend and of the kind of forward at trace time: on CPU
      decode steps unroll, training forwards scan).
  """

  arch: str = "llama"
  vocab_size: int = 49152
  hidden_size: int = 576
  intermediate_size: int = 1536
  num_layers: int = 30
  num_heads: int = 9
  num_kv_heads: int = 3
  head_dim: int | None = None
  rms_norm_eps: float = 1e-5
  rope_theta: float = 100000.0
  rope_scaling: RopeScaling | None = None
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 8192
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: bool = False
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = LORA_TARGETS
  attn_views: tuple[str, ...] = ()
  layer_loop: str = "auto"

  def __post_init__(self):
    if self.arch not in SUPPORTED_ARCHS:
      raise ValueError(f"unsupported architecture {self.arch!r}; supported: {SUPPORTED_ARCHS}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"{name}={getattr(self, name)!r} is not one of {sorted(_DTYPES)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError("hidden_size must be divisible by num_heads when head_dim is not given")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if isinstance(self.lora_targets, str):
      object.__setattr__(self, "lora_targets", tuple(t for t in self.lora_targets.split(",") if t))
    bad = set(self.lora_targets) - set(LORA_TARGETS)
    if bad:
      raise ValueError(f"unknown lora_targets {sorted(bad)}; choose from {LORA_TARGETS}")
    if self.lora_rank < 0:
      raise ValueError(f"lora_rank must be >= 0, got {self.lora_rank}")
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    views = self.attn_views
    if isinstance(views, str):
      views = tuple(v for v in views.split(",") if v)
    views = tuple(views)
    object.__setattr__(self, "attn_views", views)
    for v in views:
      if not (isinstance(v, str) and v.isidentifier()) or v == "base" or "lora" in v:
        raise ValueError(f"attn_views entry {v!r} must be an identifier other than 'base' "
                         f"without 'lora'")
    if len(set(views)) != len(views):
      raise ValueError(f"attn_views has repeated names: {views}")
    if self.layer_loop not in LAYER_LOOPS:
      raise ValueError(f"layer_loop={self.layer_loop!r} is not one of {LAYER_LOOPS}")

  def resolved_layer_loop(self, decode: bool = False) -> str:
    """``"scan"`` or ``"unroll"``: :attr:`layer_loop`, with ``"auto"`` resolved by
    :data:`AUTO_LAYER_LOOP` for the current default JAX backend and the kind of forward
    (``decode``: a step with a KV cache; else a training forward)."""
    if self.layer_loop != "auto":
      return self.layer_loop
    return AUTO_LAYER_LOOP.get((jax.default_backend(), bool(decode)), "scan")

  @property
  def qk_norm(self) -> bool:
    """Whether attention applies RMSNorm to each query/key head (Qwen3)."""
    return self.arch == "qwen3"

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    """Number of parameters (embedding counted once when tied; attention views included)."""
    d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * dh * (self.num_heads * 2 + self.num_kv_heads * 2)
    layer = attn + 3 * d * f + 2 * d + (2 * dh if self.qk_norm else 0)
    layer += len(self.attn_views) * (attn + (2 * dh if self.qk_norm else 0))
    emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * layer + emb + d

  # --- Hugging Face config.json round trip -------------------------------------------------
  def to_hf_dict(self) -> dict[str, Any]:
    """The ``config.json`` that ``transformers`` needs to load an export of this model."""
    out: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM" if self.arch == "qwen3" else "LlamaForCausalLM"],
        "model_type": self.arch,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": self.param_dtype,
    }
    if self.rope_scaling is not None:
      out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
    return out

  @classmethod
  def from_hf_dict(cls, d: Mapping[str, Any], **overrides) -> "ModelConfig":
    """Build from a Hugging Face ``config.json`` dict.

    Raises:
      ValueError: for an unsupported ``model_type`` or features we do not implement
        (attention/MLP biases, non-llama3 RoPE scaling, sliding windows).
    """
    model_type = d.get("model_type", "llama")
    if model_type not in SUPPORTED_ARCHS:
      raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_ARCHS}")
    if d.get("attention_bias") or d.get("mlp_bias"):
      raise ValueError("attention_bias / mlp_bias are not supported")
    if d.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act={d.get('hidden_act')!r} is not supported (only silu)")
    if d.get("use_sliding_window"):
      raise ValueError("sliding-window attention is not supported")
    rs = d.get("rope_scaling")
    rope_params = d.get("rope_parameters")  # transformers >= 5 may nest theta + scaling here
    theta = d.get("rope_theta")
    if isinstance(rope_params, Mapping):
      theta = theta if theta is not None else rope_params.get("rope_theta")
      if rs is None and rope_params.get("rope_type", "default") != "default":
        rs = rope_params
    scaling = None
    if rs is not None:
      rtype = rs.get("rope_type", rs.get("type"))
      if rtype in (None, "default"):
        scaling = None
      elif rtype != "llama3":
        raise ValueError(f"rope_scaling type {rtype!r} is not supported (only llama3)")
      else:
        scaling = RopeScaling(
            factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
    kw = dict(
        arch=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=int(d["num_attention_heads"]),
        num_kv_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
        head_dim=d.get("head_dim"),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
    )
    kw.update(overrides)
    return cls(**kw)


# --- presets ---------------------------------------------------------------------------------
SMOLLM2_135M = ModelConfig()  # SmolLM2-135M-Instruct, DESIGN.md §5

PRESETS: dict[str, ModelConfig] = {
    "smollm2_135m": SMOLLM2_135M,
    "tiny_llama": ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=10000.0,
                              tie_word_embeddings=False, max_position_embeddings=512),
    # SmolLM2's vocabulary and layout at toy width: tests with the real tokenizer
    "tiny_smollm2": ModelConfig(arch="llama", vocab_size=49152, hidden_size=64,
                                intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                tie_word_embeddings=True, max_position_embeddings=2048),
    "tiny_qwen3": ModelConfig(arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                              rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                              max_position_embeddings=512),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """Return a named preset (``smollm2_135m``, ``tiny_llama``, ``tiny_qwen3``).

  Raises:
    KeyError: naming the unknown preset and listing the known ones.
  """
  if name not in PRESETS:
    raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
