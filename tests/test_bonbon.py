"""BoNBoN / IPO (trainers/bonbon.py): IPO loss and pair selection against hand numbers, the
theoretical speedup, the trainer's loss against a hand computation from log-probs, one update,
and a round of the run through configs/pasta_po.py on a tiny model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from selforch_jax import sharding as shd
from selforch_jax.lang import TagVocab, build_layout
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime.annotated import random_annotated
from selforch_jax.runtime.mask import sequence_mask
from selforch_jax.trainers.bonbon import (
    BonbonTrainer, ipo_loss, pair_batch, score, select_pairs, speedups, theoretical_speedup)
from selforch_jax.trainers.optim import optim_defaults
from selforch_jax.trainers.rollouts import to_batch
from tests.repo_files import load_config

BASE = 256
TV = TagVocab.appended(BASE, 4, eos_ids=[2], digit_ids=range(48, 58), space_ids=[32])
TEXT = np.array([i for i in range(3, BASE) if not 48 <= i < 58 and i != 32])


def test_ipo_loss_hand_numbers():
  # h = (-10 - -12) - (-20 - -19) = 3; target 1/(2 tau)
  args = (jnp.array([-10.0]), jnp.array([-12.0]), jnp.array([-20.0]), jnp.array([-19.0]))
  assert float(ipo_loss(*args, tau=0.1)[0]) == pytest.approx((3 - 5) ** 2)
  assert float(ipo_loss(*args, tau=0.25)[0]) == pytest.approx((3 - 2) ** 2)
  assert float(ipo_loss(*args, tau=1 / 6)[0]) == pytest.approx(0.0, abs=1e-6)


def test_select_pairs_best_vs_worst():
  s = [[0.1, 0.5, 0.3], [1.0, 1.0, 1.0], [2.0, 0.0, 2.0], [0.0, 3.0, 3.0]]
  assert select_pairs(s) == [(0, 1, 0), (2, 0, 1), (3, 1, 0)]   # equal scores: no pair
  assert select_pairs(s, min_gap=0.45) == [(2, 0, 1), (3, 1, 0)]
  with pytest.raises(ValueError):
    select_pairs([[np.nan, 1.0]])


def test_theoretical_speedup():
  n = 7  # prompt token 0; plan tokens 1, 2; thread A = 3, 4 and thread B = 5, 6 (parallel)
  m = np.tril(np.ones((n, n), bool))
  m[5:, 3:5] = False
  assert theoretical_speedup(np.tril(np.ones((n, n), bool)), 1) == 1.0
  assert theoretical_speedup(m, 1) == pytest.approx(6 / 4)   # depths 1, 2, 3, 4, 3, 4
  assert theoretical_speedup(m, 7) == 1.0
  # real PASTA layouts: threads make it > 1; a TIP layout (one stream, evictions) stays 1
  rng = np.random.default_rng(0)
  ids, _ = random_annotated("pasta", rng, TV, TEXT)
  assert speedups([ids[:2]], [ids[2:]], TV)[0] > 1.0
  ids, _ = random_annotated("tip", rng, TV, TEXT)
  assert speedups([ids[:2]], [ids[2:]], TV)[0] == 1.0
  assert speedups([[1]], [[2, 3]], None).tolist() == [1.0]
  sc = score("pasta", speedup=[1.0, 2.0], quality=[-3.0, -1.0], lengths=[5, 9], quality_weight=0.5)
  np.testing.assert_allclose(sc, [1.0 - 1.5, 2.0 - 0.5])
  assert score("length", speedup=[1, 1], quality=[0, 0], lengths=[5, 9], quality_weight=1).tolist() == [-5, -9]


@pytest.fixture(scope="module")
def trainer():
  model = init_model(get_preset("tiny_llama", vocab_size=BASE + 11), seed=2)
  oc = optim_defaults()
  oc.lr, oc.warmup_steps, oc.schedule, oc.clip_norm = 1e-4, 0, "constant", 0.0
  return BonbonTrainer(model, shd.make_mesh(1, 1, 1), oc, 10, alpha=0.5, tau=0.1)


def test_bonbon_loss_matches_hand_computation_and_update_lowers_it(trainer):
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 256, 4)) for _ in range(4)]
  responses = [list(rng.integers(3, 256, n)) for n in (5, 3, 6, 4)]
  rows = to_batch(prompts, responses, 16)
  ref_tok = trainer.logprobs(rows, reference=True)
  ref_seq = (ref_tok * rows["loss_mask"]).sum(-1)
  batch = pair_batch(rows, ref_seq, [(0, 1), (3, 2)])
  assert batch["tokens"].shape == (4, 16) and batch["ref_seq_logp"].tolist() == ref_seq[[0, 1, 3, 2]].astype(np.float32).tolist()
  got = trainer.loss(batch)
  # pi == pi_ref at the start: h = 0, IPO = (1 / (2 tau))^2 = 25 per pair
  assert got["ipo"] == pytest.approx(25.0, abs=1e-3) and got["count"] == 2
  nll_w = [-ref_seq[0] / 5, -ref_seq[3] / 4]
  assert got["sft"] == pytest.approx(np.mean(nll_w), rel=1e-5)
  assert got["loss"] == pytest.approx(0.5 * np.mean(nll_w) + 25.0, rel=1e-5)
  trainer.train_step(batch)
  after = trainer.loss(batch)
  assert after["loss"] < got["loss"] and after["margin"] > 0   # the winner moved up vs the loser


def test_pasta_po_round_on_a_tiny_model(tmp_path):
  """configs/pasta_po.py runs a BoNBoN round end to end (tiny random model, the "ar" scheduler:
  it emits tags as text tokens, laid out with build_layout)."""
  from selforch_jax.trainers.po_run import train_po
  c = _tiny_po_config()
  s = train_po(c, str(tmp_path))
  assert s["step"] == 1 and s["optimizer_steps"] == 1
  assert s["pairs"] >= 1 and np.isfinite(s["loss"])
  assert s["ipo"] == pytest.approx(25.0, abs=1e-2)   # first update at pi = pi_ref
  assert s["speedup"] >= 1.0
  row = json.loads(open(tmp_path / "metrics.jsonl").readline())
  assert row["step"] == 1 and row["best_score"] >= row["score"]


def _tiny_po_config(arg=""):
  c = load_config("configs/pasta_po.py", "model=tiny_smollm2,steps=1,scheduler=ar,lora_rank=0"
                  + arg)
  b = c.bonbon
  b.max_new_tokens, b.num_samples, b.prompts_per_round, b.max_prompt_tokens = 6, 2, 2, 100
  b.max_examples, b.updates_per_round = 40, 1
  c.train.async_checkpoint = False
  c.optim.lr = 1e-3
  return c


def test_pasta_po_round_with_a_judge_scores_each_sample_against_its_reference(tmp_path,
                                                                              monkeypatch):
  """bonbon.quality="judge": every sample is judged against its own prompt's reference answer in
  both orders, and the round's quality is the mean of those pair scores."""
  from selforch_jax.config_lib import ConfigError
  from selforch_jax.eval.judges import LocalJudge, PairwiseJudge, pair_score
  from selforch_jax.trainers import po_run

  from selforch_jax.trainers.restore import round_step
  c = _tiny_po_config()
  c.bonbon.quality = "judge"
  c.bonbon.updates_per_round = 2
  with pytest.raises(ConfigError, match="needs bonbon.judge.backend"):
    po_run.train_po(c, str(tmp_path / "none"))
  c.bonbon.judge.backend = "openai"
  with pytest.raises(ConfigError, match="bonbon.judge.backend='openai' needs bonbon.judge.url "
                                        "and bonbon.judge.model"):
    po_run.train_po(c, str(tmp_path / "none"))
  c.bonbon.judge.backend, c.bonbon.judge.model = "openai", "m"
  c.bonbon.judge.url = "http://127.0.0.1:9"   # nothing listens: fails before any work
  with pytest.raises(ConfigError, match="did not answer a probe pair: APIConnectionError"):
    po_run.train_po(c, str(tmp_path / "unreachable"))
  assert not (tmp_path / "unreachable").exists()
  c.bonbon.judge.backend = "local"
  model, tok, tv = po_run.load_policy(c)
  local = po_run.make_po_judge(c)   # the base weights through the engine
  assert isinstance(local, LocalJudge)
  p = local.prefer("Name a colour.", "Blue.", "The sky is blue.")
  assert 0.0 < p < 1.0

  class Longer(PairwiseJudge):   # prefers the longer answer (smoothly: every sample its own
    calls = []                    # score, so that each prompt gives a pair); records its inputs

    def prefer(self, instruction, a, b):
      Longer.calls.append((instruction, a, b))
      h = lambda t: len(t) + (sum(map(ord, t)) % 101) / 101   # noqa: E731
      return float(1.0 / (1.0 + np.exp(-(h(a) - h(b)) / 10.0)))

  monkeypatch.setattr(po_run, "make_po_judge", lambda config: Longer())
  s = po_run.train_po(c, str(tmp_path / "run"))
  _, refs, instructions = po_run.load_prompts(c.bonbon, tok)
  ref_of = dict(zip(instructions, refs))
  calls = Longer.calls
  assert len(calls) == 2 * 2 * 2   # 2 prompts x 2 samples x both orders
  xs = [x for x, _, _ in calls[::2]]   # samples are prompt-major: x0, x0, x1, x1
  assert xs[0] == xs[1] != xs[2] == xs[3]
  scores = []
  for (x1, out, ref), (x2, ref2, out2) in zip(calls[::2], calls[1::2]):
    assert x1 == x2 and ref == ref2 == ref_of[x1] and out == out2
    scores.append(pair_score(Longer(), x1, out, ref))
  assert s["quality"] == pytest.approx(np.mean(scores))
  assert s["judge_unparsed"] == 0.0
  # export --round: checkpoints count optimizer steps (2 per round here)
  assert s["optimizer_steps"] == 2 and round_step(str(tmp_path / "run"), 1) == 2
  with pytest.raises(FileNotFoundError, match=r"no checkpoint of round 2 \(step 4\); rounds kept: "
                                              r"\[1\]"):
    round_step(str(tmp_path / "run"), 2)
