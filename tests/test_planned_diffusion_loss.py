"""Planned Diffusion joint loss: hand-computed value, masking rate, flags."""

import jax
import jax.numpy as jnp
import numpy as np

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
  noisy, masked, t = noise_chunks(jax.random.PRNGKey(0), ids, chunk, mask_id=9)
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
  """suffix_p=1: each chunk is a clean prefix then ceil(t * length) masks (the states of a chunk
  decoded left to right); suffix_p=0 draws exactly the i.i.d. masks it drew before the option."""
  cm = np.zeros((32, 40), bool)
  cm[:, 2:9] = True          # a 7-token chunk
  cm[:, 11:30] = True        # a 19-token chunk
  ids = jnp.arange(32 * 40, dtype=jnp.int32).reshape(32, 40)
  _, masked, t = noise_chunks(jax.random.PRNGKey(3), ids, jnp.asarray(cm), 9, 1e-3, suffix_p=1.0)
  masked, t = np.asarray(masked), np.asarray(t)
  for b in range(32):
    for lo, hi in ((2, 9), (11, 30)):
      k = int(np.ceil(t[b] * (hi - lo)))
      want = np.zeros(40, bool)
      want[hi - k:hi] = True
      np.testing.assert_array_equal(masked[b, lo:hi], want[lo:hi])
  assert not masked[:, ~cm.any(0)].any()
  key = jax.random.PRNGKey(5)
  iid = noise_chunks(key, ids, jnp.asarray(cm), 9)
  off = noise_chunks(key, ids, jnp.asarray(cm), 9, suffix_p=0.0)
  np.testing.assert_array_equal(iid[1], off[1])
  half = np.asarray(noise_chunks(key, ids, jnp.asarray(cm), 9, suffix_p=0.5)[1])
  suffix_rows = [all(np.all(np.diff(half[b, lo:hi].astype(int)) >= 0) for lo, hi in ((2, 9), (11, 30)))
                 for b in range(32)]
  assert 8 <= sum(suffix_rows) <= 28   # about half the rows (i.i.d. rows are rarely monotone)
