"""Tags of the orchestration language (selforch_jax.lang.tags / embeddings): TagVocab, add_tags on
the real SmolLM2 tokenizer and on models (embedding and untied head rows), HF export round trip."""

import copy

import numpy as np
import pytest

from selforch_jax.checkpoints import assets
from selforch_jax.lang import (
  FIXED_TAGS, TagVocab, add_tags, assemble_text, build_layout, resize_vocab, tag_strings,
)
from selforch_jax.tokenizers import Tokenizer

SMOL_TAGS = ["<promise>", "</promise>", "<async>", "</async>", "<sync/>", "<|mask|>", "[PAD]"] + [
  f"<reg_{k}>" for k in range(8)]


@pytest.fixture(scope="module")
def base_tok():
  path = assets.smollm2_gguf_path()  # make installs the GGUF: missing weights fail
  return Tokenizer.from_gguf(path)


@pytest.fixture
def tok(base_tok):
  return copy.deepcopy(base_tok)


def test_tag_vocab_basics():
  tv = TagVocab.appended(100, 3, digit_ids=range(10, 20), space_ids=[1], eos_ids=[2])
  assert tag_strings(3) == list(FIXED_TAGS) + ["<reg_0>", "<reg_1>", "<reg_2>"]
  assert tv.tags == dict(zip(tag_strings(3), range(100, 110)))
  assert tv.registers == (107, 108, 109) and tv.num_registers == 3
  assert tv.id_of("<sync/>") == 104 and tv.tag_of(104) == "<sync/>" and tv.tag_of(5) is None
  assert tv.register_of(108) == 1 and tv.register_of(104) is None
  assert tv.is_fill(105) and tv.is_fill(106) and not tv.is_fill(104)
  assert tv.encode_length(307) == [13, 10, 17]
  assert TagVocab.from_dict(tv.to_dict()) == tv
  with pytest.raises(KeyError):
    tv.id_of("<reg_3>")
  with pytest.raises(ValueError):
    TagVocab(1, 2, 3, 4, 5, 6, 6)  # duplicate ids
  with pytest.raises(ValueError):
    TagVocab.appended(100, 2, digit_ids=[1, 2, 3])
  with pytest.raises(ValueError):
    TagVocab.appended(100, 0).encode_length(3)


def test_add_tags_smollm2_tokenizer(tok):
  tv = add_tags(tok, None, num_registers=8)
  assert tv.tags == dict(zip(SMOL_TAGS, range(49152, 49152 + 15)))
  assert tok.vocab_size == 49167
  for tag, i in tv.tags.items():
    assert tok.encode(tag) == [i] and tok.decode([i]) == tag
  # digits, spaces and EOS of SmolLM2 (digits are single tokens; " " is 'Ġ')
  assert tv.digit_ids == tuple(tok.encode(str(d))[0] for d in range(10))
  assert tv.space_ids[0] == tok.encode(" ")[0] and tv.eos_ids == (tok.eos_id,)
  ids = tok.encode("Intro<promise>sleep routine 3</promise><async>Go to bed.</async><sync/>Done.")
  assert tv.split_length(ids[ids.index(tv.promise_open) + 1:ids.index(tv.promise_close)])[1] == 3
  assert assemble_text(ids, tv, tok) == "IntroGo to bed.Done."
  # idempotent; more registers are appended after the existing ones
  assert add_tags(tok, None, num_registers=8) == tv and tok.vocab_size == 49167
  tv10 = add_tags(tok, None, num_registers=10)
  assert tv10.registers == tv.registers + (49167, 49168) and tok.vocab_size == 49169
  assert TagVocab.from_tokenizer(tok) == tv10


@pytest.mark.parametrize("tied", [True, False])
def test_add_tags_grows_model_rows_and_hf_roundtrip(tok, tmp_path, tied):
  import jax.numpy as jnp

  from selforch_jax.checkpoints.safetensors_io import export_hf, import_hf
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model

  cfg = get_preset("tiny_smollm2", tie_word_embeddings=tied, num_layers=1)
  model = init_model(cfg)
  old_embed = np.asarray(model.embed[...])
  old_head = None if tied else np.asarray(model.lm_head[...])
  tv = add_tags(tok, model, num_registers=8)
  assert model.cfg.vocab_size == tok.vocab_size == 49167
  emb = np.asarray(model.embed[...])
  assert emb.shape == (49167, 64)
  np.testing.assert_array_equal(emb[:49152], old_embed)
  np.testing.assert_allclose(emb[49152:], np.broadcast_to(old_embed.mean(0), (15, 64)), rtol=1e-6, atol=1e-7)
  if not tied:
    head = np.asarray(model.lm_head[...])
    assert head.shape == (64, 49167)
    np.testing.assert_array_equal(head[:, :49152], old_head)
    np.testing.assert_allclose(head[:, 49152:], np.broadcast_to(old_head.mean(1)[:, None], (64, 15)),
                               rtol=1e-6, atol=1e-7)
  assert model.embed.get_metadata()["logical_axes"] == ("vocab", "embed")
  # idempotent: nothing changes
  add_tags(tok, model, num_registers=8)
  assert model.cfg.vocab_size == 49167
  np.testing.assert_array_equal(np.asarray(model.embed[...]), emb)
  # the grown model runs on tagged text with the builder's mask
  ids = tok.encode("Hi<promise>a 1</promise><async>b</async><sync/>c")
  lay = build_layout(ids, tv)
  logits, _ = model(jnp.asarray(ids)[None], jnp.asarray(lay.positions)[None],
                    jnp.asarray(lay.token_mask())[None])
  assert logits.shape == (1, len(ids), 49167) and np.isfinite(np.asarray(logits)).all()
  # HF export -> import keeps the rows, the tags and their ids
  export_hf(model, model.cfg, tmp_path, tokenizer=tok)
  cfg2, model2 = import_hf(tmp_path)
  assert cfg2.vocab_size == 49167 and cfg2.tie_word_embeddings == tied
  np.testing.assert_array_equal(np.asarray(model2.embed[...]), emb)
  tok2 = Tokenizer.from_hf_dir(tmp_path)
  assert TagVocab.from_tokenizer(tok2) == tv
  for tag, i in tv.tags.items():
    assert tok2.encode(tag) == [i]
  # add_tags on the restored pair is a no-op
  assert add_tags(tok2, model2) == tv and model2.cfg.vocab_size == 49167


def test_add_tags_fills_a_model_missing_rows(tok):
  """A tokenizer that already has the tags (e.g. restored) and a model that lacks their rows."""
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model

  add_tags(tok, None)
  model = init_model(get_preset("tiny_smollm2", num_layers=1))
  old = np.asarray(model.embed[...])
  add_tags(tok, model)
  assert model.cfg.vocab_size == 49167
  np.testing.assert_allclose(np.asarray(model.embed[...])[49152:],
                             np.broadcast_to(old.mean(0), (15, 64)), rtol=1e-6, atol=1e-7)
  small = init_model(get_preset("tiny_llama"))
  with pytest.raises(ValueError):
    add_tags(tok, small)  # 256 rows cannot serve a 49167-token vocabulary


def test_resize_vocab_reinitialises_padded_rows():
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model

  model = init_model(get_preset("tiny_llama"))  # untied, 256 rows
  old = np.asarray(model.embed[...])
  resize_vocab(model, 260, init_ids=[250], mean_of=200)
  emb = np.asarray(model.embed[...])
  mean = old[:200].mean(0)
  np.testing.assert_allclose(emb[[250, 256, 259]], np.broadcast_to(mean, (3, 64)), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(emb[:250], old[:250])
  assert model.lm_head[...].shape == (64, 260) and model.cfg.vocab_size == 260
  with pytest.raises(ValueError):
    resize_vocab(model, 100)
