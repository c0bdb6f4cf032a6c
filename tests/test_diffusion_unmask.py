"""runtime/diffusion_unmask: counts and confidence order on hand-worked cases."""

import numpy as np
import pytest

from selforch_jax.runtime.diffusion_unmask import confidence, select_unmask, unmask_count


def test_unmask_count():
  assert unmask_count(10, 0.5, 1.0) == 5
  assert unmask_count(10, 0.95, 1.0) == 1   # int(0.5) = 0 -> at least 1
  assert unmask_count(7, 0.0, 0.3) == 7     # last step commits all
  assert unmask_count(0, 0.5, 1.0) == 0
  with pytest.raises(ValueError, match="s < t"):
    unmask_count(3, 0.6, 0.5)


def test_confidence_kinds():
  lg = np.log(np.array([[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]]))
  np.testing.assert_allclose(confidence(lg, "prob"), [0.7, 0.4])
  np.testing.assert_allclose(confidence(lg, "margin"), [0.5, 0.0], atol=1e-12)
  ent = -np.array([-(0.7 * np.log(.7) + .2 * np.log(.2) + .1 * np.log(.1)),
                   -(2 * .4 * np.log(.4) + .2 * np.log(.2))])
  np.testing.assert_allclose(confidence(lg, "entropy"), ent)


def test_select_unmask_picks_most_confident_masked():
  lg = np.log(np.array([[0.9, 0.1], [0.6, 0.4], [0.1, 0.9], [0.55, 0.45]]))
  masked = np.array([False, True, True, True])
  tok, commit = select_unmask(lg, masked, 1, "prob")
  assert tok.tolist() == [0, 0, 1, 0] and commit.tolist() == [False, False, True, False]
  _, commit = select_unmask(lg, masked, 9, "margin")
  assert commit.tolist() == masked.tolist()
