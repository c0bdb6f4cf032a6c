"""Planned Diffusion joint loss: hand-computed value, masking rate, flags."""

import jax
import jax.numpy as jnp
import numpy as np

from selforch_jax.trainers.planned_diffusion_loss import joint_loss, noise_chunks


def test_joint_loss_hand_value():
  v = 3
  logits = jnp.zeros((1, 4, v))                       # uniform: CE = log 3 everywhere
  targets = jnp.array([[0, 1, 2, 0]], jnp.int32)
  ar = jnp.array([[False, True, False, False]])       # position 0 = prompt, no loss
  chunk = jnp.array([[False, False, True, True]])
  masked = jnp.array([[False, False, True, False]])
  t = jnp.array([0.5])
  loss, m = joint_loss(logits, targets, ar, masked, chunk, t)
  l3 = np.log(3.0)
  np.testing.assert_allclose(float(loss), (l3 + l3 / 0.5) / 3, rtol=1e-6)
  loss_up, _ = joint_loss(logits, targets, ar, masked, chunk, t, ar_over_t=True)
  np.testing.assert_allclose(float(loss_up), (l3 / 0.5 + l3 / 0.5) / 3, rtol=1e-6)
  assert float(m["tokens"]) == 3.0


def test_noise_chunks_masks_only_chunks_at_rate_t():
  ids = jnp.ones((64, 200), jnp.int32)
  chunk = jnp.zeros((64, 200), bool).at[:, 50:].set(True)
  noisy, masked, t = noise_chunks(jax.random.PRNGKey(0), ids, chunk, mask_id=9)
  assert not bool(masked[:, :50].any()) and bool((noisy[masked] == 9).all())
  rate = np.asarray(masked[:, 50:].mean(axis=1))
  np.testing.assert_allclose(rate, np.asarray(t), atol=0.15)
  assert float(t.min()) >= 1e-3 and float(t.max()) < 1.0
