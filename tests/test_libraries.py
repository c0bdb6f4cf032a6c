"""The field's libraries behind our eval helpers: scipy's bootstrap (stats.py), the ``openai``
client (judges.py, against a local stub server: no network) and ``math-verify`` (answers.py)."""

import json
import threading
import time

import numpy as np
import openai
import pytest
from scipy import stats as scipy_stats

from selforch_jax.eval import judges
from tests.fake_openai import ChatHandler, serve
from selforch_jax.eval.answers import is_correct, symbolic_equal
from selforch_jax.eval.stats import bootstrap_ci, paired_bootstrap_diff

# ---- bootstrap ---------------------------------------------------------------------------------


def test_bootstrap_ci_is_scipys_percentile_bootstrap():
  x = np.random.default_rng(1).normal(size=50)
  ours = bootstrap_ci(x, n_boot=2000, seed=7)
  ref = scipy_stats.bootstrap((x,), np.mean, n_resamples=2000, method="percentile",
                              random_state=np.random.default_rng(7)).confidence_interval
  assert ours["lo"] == pytest.approx(ref.low, abs=1e-12) and ours["hi"] == pytest.approx(ref.high, abs=1e-12)
  assert ours["mean"] == pytest.approx(x.mean()) and ours["n"] == 50


def test_paired_bootstrap_resamples_pairs_together():
  rng = np.random.default_rng(0)
  skill = rng.normal(size=200)                 # per-example difficulty shared by both systems
  a = skill + 0.1 + 0.05 * rng.normal(size=200)
  b = skill + 0.05 * rng.normal(size=200)
  d = paired_bootstrap_diff(a, b, n_boot=2000, seed=3)
  ref = scipy_stats.bootstrap((a, b), lambda u, v, axis=-1: np.mean(u - v, axis=axis), paired=True,
                              n_resamples=2000, method="percentile",
                              random_state=np.random.default_rng(3)).confidence_interval
  assert (d["lo"], d["hi"]) == pytest.approx((ref.low, ref.high), abs=1e-12)
  assert d["lo"] > 0.08 and d["hi"] < 0.12          # the true difference 0.1, tightly
  ia, ib = bootstrap_ci(a, n_boot=2000), bootstrap_ci(b, n_boot=2000)
  assert (d["hi"] - d["lo"]) < 0.1 * (ia["hi"] - ia["lo"])  # pairing removes the shared variance
  assert ia["lo"] < ib["hi"]                        # unpaired intervals overlap: they cannot tell


def test_bootstrap_single_value_and_stat_without_axis():
  assert bootstrap_ci([0.25]) == dict(mean=0.25, lo=0.25, hi=0.25, n=1)
  med = bootstrap_ci([1.0, 2.0, 3.0, 100.0], n_boot=500, stat=lambda v: float(np.median(v)))
  assert med["mean"] == 2.5 and 1.0 <= med["lo"] <= med["hi"] <= 100.0


# ---- judge client ------------------------------------------------------------------------------


class _Stub(ChatHandler):
  """Chat completions: the first ``fail_first`` requests get 503; ``delay`` seconds before each."""

  fail_first = 0
  delay = 0.0
  seen: list = []

  def reply(self, path, auth, body):
    type(self).seen.append((auth, body))
    time.sleep(type(self).delay)
    if len(type(self).seen) <= type(self).fail_first:
      return 503, None
    return 200, {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": "M"}}]}


@pytest.fixture
def stub():
  _Stub.fail_first, _Stub.delay, _Stub.seen = 0, 0.0, []
  with serve(_Stub) as url:
    yield url


def test_openai_judge_retries_a_503(stub):
  _Stub.fail_first = 1
  j = judges.OpenAIJudge(stub, "judge-x", api_key="", max_retries=2)
  assert j.prefer("q", "a", "b") == 0.0  # "M" prefers output b
  assert len(_Stub.seen) == 2             # one 503, one retry
  auth, body = _Stub.seen[-1]
  assert auth == "Bearer EMPTY" and body["model"] == "judge-x" and body["max_tokens"] == 2


def test_openai_judge_times_out(stub):
  _Stub.delay = 1.0
  j = judges.OpenAIJudge(stub, "judge-x", api_key="k", timeout_s=0.2, max_retries=1)
  t0 = time.time()
  with pytest.raises(openai.APITimeoutError):
    j.prefer("q", "a", "b")
  assert time.time() - t0 < 5.0
  time.sleep(1.2)  # let the stub finish the requests
  assert len(_Stub.seen) == 2  # the attempt and its one retry


def test_openai_judge_unreachable_is_a_connection_error():
  j = judges.OpenAIJudge("http://127.0.0.1:9/v1", "m", api_key="k", max_retries=0)
  with pytest.raises(openai.APIConnectionError):
    j.prefer("q", "a", "b")


# ---- math answers ------------------------------------------------------------------------------


@pytest.mark.parametrize("pred, ref", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5"),
    ("so 1/2 of them", "#### 0.5"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("It costs \\$1,000.", "#### 1000"),
    ("\\boxed{1000}", "\\$1,000"),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),   # math-verify
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),                            # math-verify
    ("\\boxed{\\dfrac{2}{6}}", "\\frac13"),
    ("#### 18 dollars", "#### 18"),
])
def test_equivalent_forms_are_correct(pred, ref):
  assert is_correct(pred, ref)


@pytest.mark.parametrize("pred, ref", [
    ("\\boxed{1450001}", "1450000"),
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("\\boxed{\\sqrt{3}}", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{x^2+1}", "(x+1)^2"),
])
def test_different_answers_are_wrong(pred, ref):
  assert not is_correct(pred, ref)


def test_math_verify_alone_rejects_units_that_our_normalizer_strips():
  """Why extraction and normalisation stay ours: math-verify reads words as symbols."""
  assert not symbolic_equal("18 dollars", "18")
  assert is_correct("#### 18 dollars", "18")


def test_symbolic_equal_off_the_main_thread():
  """math-verify's signal-based timeout only works in the main thread; we run without it there."""
  out = []
  t = threading.Thread(target=lambda: out.append(symbolic_equal("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}")))
  t.start()
  t.join()
  assert out == [True]
