"""GRPO (trainers/grpo.py): advantages, the clipped objective and k3 KL against hand numbers,
one update on a tiny random model, the policy-gradient limit, and the CLI run end to end."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from selforch_jax import sharding as shd
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import add_lora, init_model
from selforch_jax.trainers.grpo import GRPOTrainer, group_advantages, grpo_token_terms
from selforch_jax.trainers.logprobs import sequence_logprobs, token_logprobs
from selforch_jax.trainers.optim import optim_defaults
from selforch_jax.trainers.rewards import get_reward, register_reward
from selforch_jax.trainers.rollouts import to_batch
from tests.repo_files import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- advantages -----------------------------------------------------------------------------
def test_group_advantages_hand_values():
  a = group_advantages([[1.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 2.0]], eps=0.0)
  np.testing.assert_allclose(a[0], [1, -1, -1, 1], atol=1e-6)
  std = math.sqrt(0.5)  # population std of 1, 2, 3, 2
  np.testing.assert_allclose(a[1], [-1 / std, 0, 1 / std, 0], atol=1e-6)
  # eps enters the denominator
  np.testing.assert_allclose(group_advantages([[1.0, 0.0]], eps=0.5)[0], [0.5, -0.5], atol=1e-6)


def test_group_advantages_equal_rewards_and_single_sample_are_zero():
  a = group_advantages([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [0.0, 1.0, 0.0]])
  assert np.isfinite(a).all()
  assert (a[:2] == 0).all() and a[2, 1] > 0
  single = group_advantages([[5.0], [-2.0]])
  assert single.shape == (2, 1) and (single == 0).all()
  with pytest.raises(ValueError, match="finite"):
    group_advantages([[np.nan, 1.0]])
  with pytest.raises(ValueError, match="prompts, group"):
    group_advantages([1.0, 2.0])


# --- objective --------------------------------------------------------------------------------
def test_clipped_objective_and_k3_kl_hand_numbers():
  old = jnp.zeros((2, 3))
  logp = jnp.log(jnp.array([[1.5, 0.5, 9.0], [1.5, 0.5, 9.0]]))  # ratios; column 2 is masked
  d = jnp.array([[math.log(2), 0.0, 3.0], [0.0, -math.log(2), 3.0]])  # ref - logp
  ref = logp + d
  adv = jnp.array([1.0, -2.0])
  m = jnp.array([[1, 1, 0], [1, 1, 0]])
  s, aux = grpo_token_terms(logp, old, ref, adv, m, clip_eps=0.2, kl_coef=0.1)
  # A=+1: min(1.5, 1.2) = 1.2, min(0.5, 0.8) = 0.5; A=-2: min(-3, -2.4) = -3, min(-1, -1.6) = -1.6
  assert float(aux["pg_loss"]) == pytest.approx(-(1.2 + 0.5 - 3.0 - 1.6), abs=1e-5)
  # k3 = e^d - d - 1: (2 - ln2 - 1) + 0 + 0 + (0.5 + ln2 - 1) = 0.5
  assert float(aux["kl"]) == pytest.approx(0.5, abs=1e-5)
  assert float(s) == pytest.approx(2.9 + 0.1 * 0.5, abs=1e-5)
  assert float(aux["count"]) == 4
  assert float(aux["clip_frac"]) == 2  # (A=+1, ratio 1.5) and (A=-2, ratio 0.5)


# --- a tiny model -----------------------------------------------------------------------------
def tiny_trainer(lora=False, kl_coef=0.04, inner_steps=1, lr=1e-2):
  model = init_model(get_preset("tiny_llama"), seed=0)
  if lora:
    model = add_lora(model, 4, 8.0, "q_proj,v_proj", seed=0)
  oc = optim_defaults()
  oc.lr, oc.warmup_steps, oc.schedule, oc.clip_norm = lr, 0, "constant", 0.0
  mesh = shd.make_mesh(1, 1, 1)
  return GRPOTrainer(model, mesh, oc, 10, lora=lora, clip_eps=0.2, kl_coef=kl_coef,
                     inner_steps=inner_steps)


def fixed_batch(seed=0):
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(3, 256, 5)) for _ in range(2) for _ in range(2)]
  responses = [list(rng.integers(3, 256, n)) for n in (4, 6, 3, 5)]
  b = to_batch(prompts, responses, 16)
  b["advantages"] = group_advantages([[1.0, 0.0], [0.2, 0.9]]).reshape(-1)
  return b


def test_one_update_lowers_the_loss_and_changes_only_trainable_params():
  tr = tiny_trainer(lora=True, kl_coef=0.04, inner_steps=3)
  batch = fixed_batch()
  frozen0 = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.frozen))
  params0 = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))
  full = dict(batch, old_logp=tr.logprobs(batch), ref_logp=tr.logprobs(batch, reference=True))
  before = tr.loss(full)
  assert before["ratio"] == pytest.approx(1.0, abs=1e-5) and before["kl"] == pytest.approx(0, abs=1e-6)
  m = tr.train_step(full)
  assert m["loss"] == pytest.approx(before["loss"], abs=1e-5)
  after = tr.loss(full)
  assert after["loss"] < before["loss"] - 1e-4, (before, after)
  assert after["kl"] > 0
  frozen1 = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.frozen))
  params1 = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))
  jax.tree.map(np.testing.assert_array_equal, frozen0, frozen1)  # the base model is untouched
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a != b).any()), params0, params1))
  assert any(changed)
  # pi_ref stays the initial policy
  jax.tree.map(np.testing.assert_array_equal, params0,
               jax.tree.map(np.asarray, nnx.to_pure_dict(tr.ref_params)))
  # update(): inner_steps optimizer steps against pi_old = the policy before them
  ms = tr.update(fixed_batch(2))
  assert len(ms) == 3 and tr.step == 4
  assert ms[0]["ratio"] == pytest.approx(1.0, abs=1e-5)
  assert abs(ms[2]["ratio"] - 1.0) > 1e-5   # pi moved away from the frozen pi_old


def test_first_inner_step_with_kl_is_plain_policy_gradient():
  """At pi = pi_old = pi_ref the ratio is 1 and the k3 KL has zero gradient, so the GRPO
  gradient equals that of -sum(A * log pi) / tokens (REINFORCE with group baselines)."""
  tr = tiny_trainer(kl_coef=0.5)
  batch = fixed_batch(1)
  full = dict(batch, old_logp=tr.logprobs(batch), ref_logp=tr.logprobs(batch, reference=True))
  jb = jax.tree.map(jnp.asarray, full)
  g_grpo = jax.grad(lambda p: tr.loss_terms(p, tr.frozen, jb)[0])(tr.params)

  def pg(p):
    lp = token_logprobs(tr.merge(p, tr.frozen), jb)
    return -jnp.sum(sequence_logprobs(lp, jb["loss_mask"]) * jb["advantages"])
  g_pg = jax.grad(pg)(tr.params)
  flat_a, flat_b = jax.tree.leaves(g_grpo), jax.tree.leaves(g_pg)
  scale = max(float(jnp.abs(x).max()) for x in flat_b)
  assert scale > 0
  for a, b in zip(flat_a, flat_b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale, rtol=1e-4)


def test_gsm8k_reward():
  r = get_reward("gsm8k")
  ref = "She pays 3 * 4 = <<3*4=12>>12 dollars.\n#### 12"
  assert r("So the total is 12.\n#### 12", ref, 0.1) == pytest.approx(1.1)
  assert r("The total is 12", ref, 0.1) == pytest.approx(1.0)      # right, no explicit format
  assert r("#### 13", ref, 0.1) == pytest.approx(0.1)              # formatted, wrong
  assert r("no idea", ref, 0.1) == 0.0
  with pytest.raises(KeyError, match="gsm8k"):
    get_reward("nope")


# --- the run: CLI dispatch, resume ------------------------------------------------------------
@register_reward("test_chars")  # varies between random samples, so advantages are non-zero
def _chars(text, reference, format_weight=0.0):
  return len(text) / 50.0


GRPO = {"trainer": "grpo", "grpo.max_new_tokens": 6, "grpo.group_size": 2,
        "grpo.prompts_per_step": 1, "grpo.max_prompt_tokens": 100, "grpo.max_examples": 40,
        "grpo.inner_steps": 2, "grpo.reward": "test_chars", "train.checkpoint_every": 1,
        "train.async_checkpoint": False, "optim.warmup_steps": 0, "optim.lr": 1e-2}
SFT_ARG = "configs/sft.py:model=tiny_smollm2,lora_rank=0,steps=2"


def grpo_config():
  c = load_config("configs/sft.py", SFT_ARG.split(":", 1)[1])
  for key, val in GRPO.items():
    *sect, k = key.split(".")
    (c[sect[0]] if sect else c)[k] = val
  return c


def _initial_params(c):
  from selforch_jax.trainers.po_run import load_policy
  model, _, _ = load_policy(c)
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def final_params(workdir):
  """``(step, trainable params as numpy)`` of the latest checkpoint in ``workdir``."""
  import orbax.checkpoint as ocp
  from selforch_jax.trainers.checkpoint import Checkpointer
  ck = Checkpointer(workdir, async_save=False)
  step = ck.latest_step()
  ck.close()
  state = ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"))
  return step, jax.tree.map(np.asarray, state["params"])


def test_cli_dispatches_grpo_end_to_end(tmp_path):
  """``python -m selforch_jax.train`` runs GRPO when ``config.trainer="grpo"``."""
  wd = str(tmp_path / "cli")
  # the test reward is registered in this process only: the CLI run uses gsm8k's
  args = [f"--config.{k}={v}" for k, v in GRPO.items() if k != "grpo.reward"]
  proc = subprocess.run([sys.executable, "-m", "selforch_jax.train",
                         f"--config={SFT_ARG.replace('steps=2', 'steps=1')}", *args,
                         f"--workdir={wd}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout[proc.stdout.index("{"):])
  assert summary["step"] == 1 and summary["optimizer_steps"] == 2
  rows = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [1]
  r = rows[0]
  assert np.isfinite(r["loss"]) and np.isfinite(r["kl"]) and r["response_tokens"] >= 1
  assert 0 <= r["reward"] <= 1.1 and "rollout_s" in r
  assert final_params(wd)[0] == 2


def test_resume_after_interruption_equals_straight_run(tmp_path):
  """A run stopped after one rollout step and resumed ends with the straight run's parameters."""
  from selforch_jax.trainers.po_run import train_po
  c = grpo_config()
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  sa = train_po(c, a)
  assert sa["grad_norm"] > 0 and sa["zero_adv_groups"] < 1
  sb = train_po(c, b, stop_at=1)
  assert sb["step"] == 1 and final_params(b)[0] == 2
  sb = train_po(c, b)
  assert sb["step"] == 2
  assert sb["batch_crc32"] == sa["batch_crc32"] and sb["reward"] == sa["reward"]
  step_a, pa = final_params(a)
  step_b, pb = final_params(b)
  assert step_a == step_b == 4
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), pa, pb)
  # and training moved the parameters
  assert any(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.abs(x - y).max() > 1e-4), pa,
                                          _initial_params(c))))
