"""Parity of our Transformer with Hugging Face transformers (PyTorch CPU) on tiny random models.

Covers the one HF<->ours mapping (checkpoints/hf_layout.py), the safetensors export
(loadable by ``AutoModelForCausalLM.from_pretrained``) and import (incl. sharded
checkpoints written by ``save_pretrained``), and the errors for bad input.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file

from selforch_jax.checkpoints.hf_layout import hf_from_params, model_from_params, params_from_hf
from selforch_jax.checkpoints.safetensors_io import export_hf, import_hf
from selforch_jax.models.config import ModelConfig
from selforch_jax.models.transformer import causal_mask, param_dict, positions_from_valid

TOL = 1e-4
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               rms_norm_eps=1e-6, max_position_embeddings=128)

CASES = {
    # GQA, untied, no rope scaling
    "llama_gqa_untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2,
                                       rope_theta=10000.0, tie_word_embeddings=False)),
    # tied, GQA, llama3 rope scaling whose band falls inside head_dim=16's wavelengths
    "llama_llama3rope_tied": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=1, rope_theta=10000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # MHA, untied, llama3 scaling
    "llama_mha_llama3rope_untied": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=4, rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0,
                      "high_freq_factor": 8.0, "original_max_position_embeddings": 32})),
    # Qwen3: q/k norm, head_dim != hidden / heads
    "qwen3_tied": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3_untied": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   rope_theta=10000.0, tie_word_embeddings=False)),
}


def _hf_model(arch: str, kw: dict, seed: int = 0):
  torch.manual_seed(seed)
  cls_cfg = transformers.LlamaConfig if arch == "llama" else transformers.Qwen3Config
  hf_cfg = cls_cfg(**_COMMON, **kw, attn_implementation="eager")
  cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen3ForCausalLM
  model = cls(hf_cfg).float().eval()
  # HF init (std 0.02, unit norms) gives near-uniform logits; use O(1) activations and
  # non-trivial norms so a swapped or mis-transposed tensor cannot hide.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
  return model


def _batch(seed: int = 0, B: int = 3, T: int = 16, vocab: int = 256):
  """Tokens with row 1 left-padded by 5 and row 2 right-padded by 3."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
  valid = np.ones((B, T), bool)
  valid[1, :5] = False
  valid[2, -3:] = False
  tokens[~valid] = 0
  return tokens, valid


def _ours_logits(model, tokens, valid):
  v = jnp.asarray(valid)
  logits, _ = model(jnp.asarray(tokens), positions_from_valid(v), causal_mask(v))
  return np.asarray(logits)


def _torch_logits(model, tokens, valid):
  pos = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(valid.astype(np.int64)),
                position_ids=torch.tensor(pos, dtype=torch.long))
  return out.logits.float().numpy()


def _state_dict_np(model):
  return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
  arch, kw = CASES[request.param]
  hf = _hf_model(arch, kw)
  cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
  ours = model_from_params(cfg, params_from_hf(cfg, _state_dict_np(hf)))
  tokens, valid = _batch()
  return dict(name=request.param, hf=hf, cfg=cfg, ours=ours, tokens=tokens, valid=valid,
              ref=_torch_logits(hf, tokens, valid))


def test_config_round_trip(case):
  cfg, hf = case["cfg"], case["hf"]
  assert cfg.arch == hf.config.model_type
  assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
  assert cfg.head_dim == hf.config.head_dim
  assert (cfg.rope_scaling is not None) == ("llama3" in case["name"])
  assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_logits_match_transformers(case):
  got = _ours_logits(case["ours"], case["tokens"], case["valid"])
  ref, valid = case["ref"], case["valid"]
  diff = np.abs(got - ref)[valid].max()
  print(f"{case['name']}: max |ours - torch| = {diff:.3g} (logit scale {np.abs(ref).max():.3g})")
  assert np.abs(ref[valid]).max() > 1.0  # the logits are not trivially small
  assert diff <= TOL
  if case["cfg"].rope_scaling is not None:  # the scaling matters at these positions
    cfg0 = case["cfg"].replace(rope_scaling=None)
    unscaled = model_from_params(cfg0, param_dict(case["ours"]))
    assert np.abs(_ours_logits(unscaled, case["tokens"], valid) - ref)[valid].max() > 1e-2


def test_hf_round_trip_is_exact(case):
  """hf_from_params(params_from_hf(x)) == x for every tensor HF saves."""
  sd = _state_dict_np(case["hf"])
  back = hf_from_params(case["cfg"], param_dict(case["ours"]))
  expected = {k: v for k, v in sd.items()
              if not (case["cfg"].tie_word_embeddings and k == "lm_head.weight")}
  assert set(back) == set(expected)
  for k, v in expected.items():
    np.testing.assert_array_equal(back[k], v, err_msg=k)
  assert ("lm_head.weight" in back) == (not case["cfg"].tie_word_embeddings)


def test_export_loads_in_transformers_and_imports_exactly(case, tmp_path):
  cfg, ours = case["cfg"], case["ours"]
  tokens, valid = case["tokens"], case["valid"]
  mine = _ours_logits(ours, tokens, valid)
  out = export_hf(ours, cfg, tmp_path / "export")
  names = set(os.listdir(out))
  assert {"config.json", "model.safetensors", "generation_config.json"} <= names
  saved = load_file(os.path.join(out, "model.safetensors"))
  assert ("lm_head.weight" in saved) == (not cfg.tie_word_embeddings)

  hf2 = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32, attn_implementation="eager").eval()
  assert type(hf2).__name__ == type(case["hf"]).__name__
  theirs = _torch_logits(hf2, tokens, valid)
  d_exp = np.abs(theirs - mine)[valid].max()
  print(f"{case['name']}: exported, max |transformers(export) - ours| = {d_exp:.3g}")
  assert d_exp <= TOL
  assert np.abs(theirs - case["ref"])[valid].max() <= TOL

  cfg2, back = import_hf(out)
  assert cfg2 == cfg
  np.testing.assert_array_equal(_ours_logits(back, tokens, valid), mine)


def test_import_sharded_save_pretrained(tmp_path):
  """A sharded checkpoint written by transformers' own save_pretrained imports exactly."""
  arch, kw = CASES["qwen3_untied"]
  hf = _hf_model(arch, kw, seed=3)
  hf.save_pretrained(tmp_path, max_shard_size="40KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  assert not os.path.exists(tmp_path / "model.safetensors")
  cfg, ours = import_hf(tmp_path)
  tokens, valid = _batch(seed=1)
  diff = np.abs(_ours_logits(ours, tokens, valid) - _torch_logits(hf, tokens, valid))[valid].max()
  assert diff <= TOL
  ref = model_from_params(cfg, params_from_hf(cfg, _state_dict_np(hf)))
  np.testing.assert_array_equal(_ours_logits(ours, tokens, valid),
                                _ours_logits(ref, tokens, valid))


def test_bf16_export_and_param_dtype(tmp_path):
  arch, kw = CASES["llama_gqa_untied"]
  hf = _hf_model(arch, kw, seed=4)
  cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
  ours = model_from_params(cfg, params_from_hf(cfg, _state_dict_np(hf)))
  out = export_hf(ours, cfg, tmp_path, dtype="bfloat16")
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  saved = load_file(os.path.join(out, "model.safetensors"))
  assert all(str(v.dtype) == "bfloat16" for v in saved.values())
  cfg2, back = import_hf(out, param_dtype="bfloat16")
  assert cfg2.param_dtype == "bfloat16" and cfg2.dtype == "bfloat16"
  assert back.embed[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(back.embed[...], np.float32),
                                np.asarray(jnp.asarray(ours.embed[...]).astype(jnp.bfloat16),
                                           np.float32))
  # float32 compute over bf16-rounded weights stays near the float32 model
  _, back32 = import_hf(out, param_dtype="float32")
  tokens, valid = _batch()
  d = np.abs(_ours_logits(back32, tokens, valid) - _ours_logits(ours, tokens, valid))[valid].max()
  assert 0 < d < 0.25


def test_export_calls_tokenizer_save_hf(tmp_path):
  class Tok:
    bos_token_id, eos_token_id = 1, 2

    def save_hf(self, d):
      with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write("{}")

  arch, kw = CASES["qwen3_tied"]
  hf = _hf_model(arch, kw)
  cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
  ours = model_from_params(cfg, params_from_hf(cfg, _state_dict_np(hf)))
  export_hf(ours, cfg, tmp_path, tokenizer=Tok())
  assert os.path.exists(tmp_path / "tokenizer.json")
  with open(tmp_path / "generation_config.json") as f:
    gen = json.load(f)
  assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2


# --- bad input ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  arch, kw = CASES["llama_gqa_untied"]
  hf = _hf_model(arch, kw)
  cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
  ours = model_from_params(cfg, params_from_hf(cfg, _state_dict_np(hf)))
  return export_hf(ours, cfg, tmp_path_factory.mktemp("exp"))


def _copy(src, dst):
  os.makedirs(dst, exist_ok=True)
  for n in os.listdir(src):
    with open(os.path.join(src, n), "rb") as f, open(os.path.join(dst, n), "wb") as g:
      g.write(f.read())


def test_unsupported_model_type(exported, tmp_path):
  _copy(exported, tmp_path)
  with open(tmp_path / "config.json") as f:
    d = json.load(f)
  d["model_type"] = "gpt2"
  with open(tmp_path / "config.json", "w") as f:
    json.dump(d, f)
  with pytest.raises(ValueError, match="gpt2"):
    import_hf(tmp_path)


def test_missing_paths(exported, tmp_path):
  with pytest.raises(FileNotFoundError, match="nowhere"):
    import_hf(tmp_path / "nowhere")
  _copy(exported, tmp_path)
  os.remove(tmp_path / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    import_hf(tmp_path)


def test_shape_mismatch_and_missing_tensor(exported, tmp_path):
  _copy(exported, tmp_path)
  t = dict(load_file(tmp_path / "model.safetensors"))
  name = "model.layers.1.self_attn.k_proj.weight"
  t[name] = np.zeros((16, 64), np.float32)  # expected (32, 64)
  save_file(t, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
    import_hf(tmp_path)
  del t[name]
  t["model.layers.1.self_attn.q_proj.bias"] = np.zeros((64,), np.float32)
  save_file(t, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"missing.*k_proj\.weight.*unexpected.*q_proj\.bias"):
    import_hf(tmp_path)


def test_tied_lm_head_must_equal_embedding():
  arch, kw = CASES["qwen3_tied"]
  hf = _hf_model(arch, kw)
  cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
  sd = _state_dict_np(hf)
  sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1.0
  with pytest.raises(ValueError, match="tie_word_embeddings"):
    params_from_hf(cfg, sd)
