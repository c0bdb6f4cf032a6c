"""Planned Diffusion joint loss: hand-computed value, masking rate, flags."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from selforch_jax.trainers.planned_diffusion_loss import chunk_offsets, joint_loss, noise_chunks


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
  noisy, masked, t, rate = noise_chunks(jax.random.PRNGKey(0), ids, chunk, mask_id=9)
  np.testing.assert_array_equal(rate, np.broadcast_to(np.asarray(t)[:, None], rate.shape))
  assert not bool(masked[:, :50].any()) and bool((noisy[masked] == 9).all())
  rate = np.asarray(masked[:, 50:].mean(axis=1))
  np.testing.assert_allclose(rate, np.asarray(t), atol=0.15)
  assert float(t.min()) >= 1e-3 and float(t.max()) < 1.0


def test_chunk_offsets_by_hand():
  cm = jnp.array([[0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0], [1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1]], bool)
  offset, length = chunk_offsets(cm)
  np.testing.assert_array_equal(offset, [[0, 0, 1, 2, 0, 0, 0, 1, 2, 3, 4, 0],
                                         [0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]])
  np.testing.assert_array_equal(length, [[0, 3, 3, 3, 0, 0, 5, 5, 5, 5, 5, 0],
                                         [2, 2, 0, 1, 0, 0, 0, 0, 0, 0, 2, 2]])


def test_suffix_noise_masks_the_last_ceil_t_len_of_every_chunk():
  """suffix_p=1: each chunk is a clean prefix then k = ceil(t * L) masks (the states of a chunk
  decoded left to right), each of rate k / L; suffix_p=0 draws exactly the i.i.d. masks of the
  rule before the option (pinned here)."""
  cm = np.zeros((32, 40), bool)
  cm[:, 2:9] = True          # a 7-token chunk
  cm[:, 11:30] = True        # a 19-token chunk
  ids = jnp.arange(32 * 40, dtype=jnp.int32).reshape(32, 40)
  _, masked, t, rate = noise_chunks(jax.random.PRNGKey(3), ids, jnp.asarray(cm), 9, 1e-3,
                                    suffix_p=1.0)
  masked, t, rate = np.asarray(masked), np.asarray(t), np.asarray(rate)
  for b in range(32):
    for lo, hi in ((2, 9), (11, 30)):
      k = int(np.ceil(t[b] * np.float32(hi - lo)))
      want = np.zeros(40, bool)
      want[hi - k:hi] = True
      np.testing.assert_array_equal(masked[b, lo:hi], want[lo:hi])
      np.testing.assert_allclose(rate[b, lo:hi], k / (hi - lo), rtol=1e-6)
    np.testing.assert_allclose(rate[b, ~cm[b]], t[b])
  assert not masked[:, ~cm.any(0)].any()
  key = jax.random.PRNGKey(5)
  kt, km = jax.random.split(key)
  t_old = jax.random.uniform(kt, (32,), jnp.float32, minval=1e-3, maxval=1.0)
  old = np.asarray(jnp.asarray(cm) & (jax.random.uniform(km, (32, 40)) < t_old[:, None]))
  np.testing.assert_array_equal(noise_chunks(key, ids, jnp.asarray(cm), 9, suffix_p=0.0)[1], old)
  half = np.asarray(noise_chunks(key, ids, jnp.asarray(cm), 9, suffix_p=0.5)[1])
  suffix_rows = [all(np.all(np.diff(half[b, lo:hi].astype(int)) >= 0) for lo, hi in ((2, 9), (11, 30)))
                 for b in range(32)]
  assert 8 <= sum(suffix_rows) <= 28   # about half the rows (i.i.d. rows are rarely monotone)
  with pytest.raises(ValueError, match="suffix_p must be in"):
    noise_chunks(key, ids, jnp.asarray(cm), 9, suffix_p=1.5)


def test_joint_loss_per_target_rates():
  """t of shape [B, N] weights each masked target by its own 1 / rate."""
  logits = jnp.zeros((1, 3, 4))            # uniform: every CE is log 4
  targets = jnp.zeros((1, 3), jnp.int32)
  ar = jnp.array([[True, False, False]])
  masked = jnp.array([[False, True, True]])
  chunk = jnp.array([[False, True, True]])
  rate = jnp.array([[0.9, 0.5, 0.25]])
  loss, _ = joint_loss(logits, targets, ar, masked, chunk, rate)
  l4 = float(np.log(4.0))
  np.testing.assert_allclose(float(loss), (l4 + l4 / 0.5 + l4 / 0.25) / 3, rtol=1e-6)
