"""runtime/diffusion_unmask: counts and confidence order on hand-worked cases; the spread
order against a direct numpy reference."""

import numpy as np
import pytest

from selforch_jax.runtime.diffusion_unmask import (confidence, select_spread, select_unmask,
                                                   unmask_count)


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


def _spread_ref(conf, cand, count):
  """Reference: repeatedly take the most confident candidate (lowest index on ties) that is
  neither picked nor next to a picked one, until ``count`` are picked or none is eligible."""
  conf, cand = np.asarray(conf, float), np.asarray(cand, bool)
  picked = np.zeros(conf.size, bool)
  while picked.sum() < count:
    near = picked | np.roll(picked, 1) & (np.arange(conf.size) > 0) \
        | np.roll(picked, -1) & (np.arange(conf.size) < conf.size - 1)
    ok = cand & ~near
    if not ok.any():
      break
    picked[int(np.argmax(np.where(ok, conf, -np.inf)))] = True
  return picked


def test_select_spread_hand_built():
  # slots 0 and 1 are the two most confident: plain order commits both, spread skips slot 1
  lg = np.log(np.array([[0.95, 0.05], [0.9, 0.1], [0.5, 0.5], [0.8, 0.2], [0.6, 0.4]]))
  masked = np.ones(5, bool)
  conf = confidence(lg, "prob")
  _, plain = select_unmask(lg, masked, 2, "prob")
  assert plain.tolist() == [True, True, False, False, False]
  assert select_spread(conf, masked, 2).tolist() == [True, False, False, True, False]
  # committed neighbours (slots 1 and 3 not masked) block nothing: 0, 2 and 4 all go
  m2 = np.array([True, False, True, False, True])
  assert select_spread(conf, m2, 3).tolist() == [True, False, True, False, True]
  # 0 then 3 (by confidence); 4 and 2 sit next to 3: 2 picks for a count of 3
  assert select_spread(conf, masked, 3).tolist() == [True, False, False, True, False]
  # fewer eligible than the count: it stops there (3 masked in a row -> 2 picks)
  m3 = np.array([False, True, True, True, False])
  assert select_spread(conf, m3, 3).tolist() == [False, True, False, True, False]
  assert not select_spread(conf, masked, 0).any()
  with pytest.raises(ValueError, match="count"):
    select_spread(conf, masked, -1)
  with pytest.raises(ValueError, match="shape"):
    select_spread(conf, masked[:3], 1)


def test_select_spread_matches_reference():
  rng = np.random.default_rng(0)
  for trial in range(300):
    L = int(rng.integers(1, 14))
    lg = rng.normal(size=(L, 6)) * 3
    conf = confidence(lg, ("entropy", "margin", "prob")[trial % 3])
    if trial % 4 == 0:
      conf = np.round(conf, 1)            # ties: the lower index first
    cand = rng.random(L) < 0.7
    count = int(rng.integers(0, L + 2))
    got = select_spread(conf, cand, count)
    np.testing.assert_array_equal(got, _spread_ref(conf, cand, count))
    assert not (got & ~cand).any() and got.sum() <= count
    assert not (got[1:] & got[:-1]).any()   # never two neighbours
    if count and cand.any():
      assert got[int(np.argmax(np.where(cand, conf, -np.inf)))]
