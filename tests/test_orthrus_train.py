"""The Orthrus trainer (selforch_jax.trainers.orthrus): only the diffusion view moves, blocks are
counted only on response rows, the KL loss falls when fitting a fixed batch (and CE runs), the
data sources refuse evaluation sets, and one end-to-end run of ``configs/orthrus.py`` on a toy
SmolLM2-vocabulary model (continuation cache with provenance, Orbax resume, adapter) whose adapter
decodes through the API with ``runtime=orthrus`` token-identical to ``runtime=ar``."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from selforch_jax import config_lib, sharding as shd
from selforch_jax.models.orthrus import add_orthrus, add_view_delta
from selforch_jax.trainers.optim import optim_defaults
from selforch_jax.trainers.orthrus import OrthrusTrainer
from selforch_jax.trainers.orthrus_data import parse_sources
from tests.spec_prompts import tiny_model

B = 4


def _batch(rng, n_rows=2, N=40, prompt=8):
  tokens = rng.integers(0, 256, (n_rows, N)).astype(np.int32)
  lm = np.zeros((n_rows, N), np.int32)
  lm[:, prompt - 1:N - 6] = 1
  seg = np.ones((n_rows, N), np.int32)
  seg[:, N - 4:] = 0
  return dict(tokens=tokens, targets=np.roll(tokens, -1, 1), loss_mask=lm, segment_ids=seg,
              positions=np.broadcast_to(np.arange(N, dtype=np.int32), (n_rows, N)).copy())


def _trainer(loss="kl", low_rank=True, lr=3e-3, denoise="single"):
  m, mask_id = add_orthrus(tiny_model())
  if low_rank:
    add_view_delta(m, 4)
  o = optim_defaults()
  o.lr, o.warmup_steps, o.schedule = lr, 0, "constant"
  mesh = shd.make_mesh(-1, 1, 1)
  return OrthrusTrainer(m, mesh, o, 100, block_size=B, mask_id=mask_id, loss=loss,
                        low_rank=low_rank, denoise=denoise), m


@pytest.mark.parametrize("low_rank", [True, False])
def test_only_the_view_trains_and_kl_falls(low_rank):
  tr, m0 = _trainer(low_rank=low_rank)
  before = {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(
      nnx.to_pure_dict(tr.frozen))}
  batch = _batch(np.random.default_rng(0))
  batch["offset"] = np.zeros((2, 1), np.int32)
  first = tr.train_step(batch)["loss"]
  for _ in range(25):
    last = tr.train_step(batch)["loss"]
  assert last < 0.7 * first, (first, last)
  after = {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(
      nnx.to_pure_dict(tr.frozen))}
  assert before.keys() == after.keys()
  for k in before:                       # embeddings, AR projections, MLPs, head: unchanged
    np.testing.assert_array_equal(before[k], after[k])
  names = {str(p[-1]) for p, _ in jax.tree_util.tree_leaves_with_path(
      nnx.to_pure_dict(tr.params))}
  assert names and all("diffusion" in n for n in names)


def test_blocks_count_only_response_rows_and_eval_figures():
  tr, _ = _trainer()
  batch = _batch(np.random.default_rng(1))
  batch["offset"] = np.asarray([[0], [3]], np.int32)
  t = jax.device_get(tr._eval(tr.params, tr.frozen, tr.put_batch(batch)))
  # rows 7..33 are response targets: block k = [s, s+B-2] with s = off + 4k fully inside
  want = sum(sum(1 for s in range(off, 40, B) if s >= 7 and s + B - 2 <= 33) for off in (0, 3))
  assert t["blocks"] == want and t["rows"] == want * (B - 1)
  ev = tr.eval_loss([batch])
  assert 0 <= ev["eval_match"] <= 1 and 1 <= ev["eval_accept_len"] <= B
  ce, _ = _trainer(loss="ce")
  assert np.isfinite(ce.train_step(dict(batch))["loss"])


def test_sources_refuse_evaluation_sets():
  assert parse_sources("gsm8k:3+alpaca:2") == [("gsm8k", 3), ("alpaca", 2)]
  for bad in ("alpaca_eval:5", "aime:1", "gsm8k", "mystery:2"):
    with pytest.raises(ValueError):
      parse_sources(bad)


def test_orthrus_run_end_to_end(tmp_path):
  from selforch_jax import api
  from selforch_jax.adapter import load_adapter
  from selforch_jax.api import load_config_file
  from selforch_jax.trainers.run import train
  arg = (f"model=tiny_smollm2,sources=gsm8k:6+alpaca:2,max_new_tokens=12,steps=3,seq_len=96,"
         f"batch_size=2,data_path={tmp_path}/data.jsonl")
  c = load_config_file("configs/orthrus.py", arg)
  c.train.async_checkpoint = False
  c.train.checkpoint_every = 2
  out = train(c, str(tmp_path / "run"), stop_at=2)
  assert out["step"] == 2
  with open(tmp_path / "data.jsonl.provenance.json") as f:
    prov = json.load(f)
  assert prov["rows"] == 8 and prov["sources"] == [["gsm8k", 6], ["alpaca", 2]]
  out = train(c, str(tmp_path / "run"))          # resumes at 2, writes the adapter
  assert out["step"] == 3
  with open(os.path.join(out["adapter"], "adapter_config.json")) as f:
    meta = json.load(f)
  assert meta["kind"] == "orthrus" and meta["view_rank"] == 16 and meta["source"]["step"] == 3
  model, tok = load_adapter(out["adapter"])
  prompts = [tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
             for q in ("What is 2 + 3?", "Name a color.")]
  o = api.decode_ids(model, tok, prompts, runtime="orthrus", max_new_tokens=24)
  a = api.decode_ids(model, tok, prompts, runtime="ar", max_new_tokens=24)
  assert [x.token_ids for x in o] == [x.token_ids for x in a]
  assert all(x.forwards > 0 and x.tokens_per_forward > 0 for x in o)
  assert "diffusion_forwards" in o[0].figures
  with pytest.raises(config_lib.ConfigError, match="packing"):
    c2 = load_config_file("configs/orthrus.py", arg)
    c2.data.packing = True
    train(c2, str(tmp_path / "bad"))


def test_multi_denoise_counts_only_unrevealed_target_rows():
  """A hand-checked case (B = 4, one row of 13 tokens, blocks at 0, 4, 8, all on response rows):
  reveal [1,1,0,1] counts row 1 only (rows 0 and 2 predict revealed slots 1 and 3), [1,0,0,0]
  rows 0..2, [1,1,1,1] none: 4 rows; the sums equal KL / CE over exactly those rows of the
  dual pass with the reveal, and eval figures stay single-step (equal to a single run's)."""
  from selforch_jax.models.orthrus import dual_pass_logits
  N = 13
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 200, (1, N)).astype(np.int32)
  batch = dict(tokens=tokens, targets=np.roll(tokens, -1, 1),
               loss_mask=np.ones((1, N), np.int32), segment_ids=np.ones((1, N), np.int32),
               positions=np.arange(N, dtype=np.int32)[None], offset=np.zeros((1, 1), np.int32))
  rev = np.asarray([[1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1]], bool)
  want = [(0, 1), (1, 0), (1, 1), (1, 2)]                  # (block, row) counted
  ar = diff = None
  for loss in ("kl", "ce"):                 # same init: the same dual pass for both losses
    tr, _ = _trainer(loss=loss, denoise="multi")
    t = jax.device_get(tr._eval(tr.params, tr.frozen, tr.put_batch(dict(batch, reveal=rev))))
    assert t["rows"] == len(want) and t["blocks"] == 3
    if ar is None:
      m = tr.current_model()
      fwd = jax.jit(lambda x: dual_pass_logits(
          m, x, jnp.asarray(batch["positions"]), jnp.ones((1, N), bool),
          jnp.asarray([[0, 4, 8]]), B, tr.mask_id, reveal=jnp.asarray(rev.reshape(1, 3, B))))
      ar, diff = fwd(jnp.asarray(tokens))
      ar, diff = np.asarray(ar[0], np.float64), np.asarray(diff[0], np.float64)
    tot = 0.0
    for k, i in want:
      lq = diff[k, i] - np.log(np.sum(np.exp(diff[k, i] - diff[k, i].max()))) - diff[k, i].max()
      if loss == "kl":
        lp = ar[4 * k + i] - np.log(np.sum(np.exp(ar[4 * k + i] - ar[4 * k + i].max()))) \
            - ar[4 * k + i].max()
        tot += float(np.sum(np.exp(lp) * (lp - lq)))
      else:
        tot += -float(lq[tokens[0, 4 * k + i + 1]])
    np.testing.assert_allclose(float(t["loss_sum"]), tot, rtol=2e-4)
  single, _ = _trainer(loss="ce")
  b = {k: v for k, v in batch.items()}
  assert tr.eval_loss([b]) == single.eval_loss([b])        # eval reveals nothing


def test_multi_denoise_trains_only_the_view_and_draws_reveal_from_seed_and_step():
  from selforch_jax.trainers.orthrus import draw_reveal
  r1, r2 = draw_reveal(0, 5, 3, 7, B), draw_reveal(0, 5, 3, 7, B)
  np.testing.assert_array_equal(r1, r2)
  assert r1.shape == (3, 7 * B) and r1.reshape(3, 7, B)[:, :, 0].all()
  assert not np.array_equal(r1, draw_reveal(0, 6, 3, 7, B))
  assert 0.2 < draw_reveal(1, 0, 64, 8, B).reshape(64, 8, B)[:, :, 1:].mean() < 0.8   # E = 1/2
  tr, _ = _trainer(denoise="multi")
  with pytest.raises(ValueError, match="denoise"):
    _trainer(denoise="many")
  frozen0 = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.frozen))
  params0 = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))
  batch = _batch(np.random.default_rng(0))
  put = tr.put_batch(batch)
  assert put["reveal"].shape == (2, ((40 - 1) // B) * B)
  losses = [tr.train_step(batch)["loss"] for _ in range(6)]
  assert all(np.isfinite(losses))
  jax.tree.map(np.testing.assert_array_equal, frozen0,
               jax.tree.map(np.asarray, nnx.to_pure_dict(tr.frozen)))
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), params0,
                                       nnx.to_pure_dict(tr.params)))
  assert any(moved)
