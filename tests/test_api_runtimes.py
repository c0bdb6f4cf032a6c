"""Every runtime through :func:`selforch_jax.api.decode_ids` on a tiny random model with the
orchestration tags (tests/trace_fixtures.py): the fields of each answer, the runtime's own
figures, stop strings cutting the text, and the ``degraded`` finish of malformed annotations."""

import pytest

from selforch_jax import api
from selforch_jax.models.orthrus import add_orthrus
from selforch_jax.runtime.generation import GenerationResult
from tests.trace_fixtures import RUNTIMES, TV, forced_plan_prompt, tiny  # noqa: F401

QUESTION = "Name three colors."
BUDGET = 12
FIGURES = {
    "ar": set(), "streaming_llm": {"mean_live_kv_tokens", "peak_live_kv_tokens",
                                   "peak_live_kv_bytes"},
    "h2o": {"mean_live_kv_tokens", "peak_live_kv_tokens", "peak_live_kv_bytes"},
    "tip": {"mean_live_kv_tokens", "peak_live_kv_tokens", "peak_live_kv_bytes", "degraded", "raw"},
    "pasta": {"threads", "rounds", "max_parallel", "theoretical_speedup", "content_tokens",
              "well_formed", "degraded", "raw"},
    "sot": {"points", "parsed", "tokens"}, "apar": {"forks", "max_parallel", "tokens"},
}


def _prompt(tok, runtime):
  if runtime == "pasta":
    return forced_plan_prompt(tok)              # forks three threads at once
  if runtime == "apar":
    return tok.encode("Steps:\n1.")            # ends in a list-item start: forks at once
  return tok.encode_chat([{"role": "user", "content": QUESTION}])


def _decode(tiny, runtime, n=8, **kw):
  model, tok = tiny
  opts = {"budget": BUDGET} if runtime in ("streaming_llm", "h2o") else {}
  p = _prompt(tok, runtime)
  a, = api.decode_ids(model, tok, [p], runtime=runtime, max_new_tokens=n, tag_vocab=TV,
                      questions=[QUESTION], options=opts, **kw)
  return a, p


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_answer_fields_and_figures(tiny, runtime):
  _, tok = tiny
  a, p = _decode(tiny, runtime)
  d = a.to_dict()
  assert set(d) == {"text", "token_ids", "finish_reason", "forwards", "tokens_per_forward",
                    "wall_s", "prompt_tokens", "logprobs", "figures"}
  assert isinstance(a.text, str) and all(isinstance(t, int) for t in a.token_ids)
  assert a.finish_reason in ("stop", "length", "degraded")
  assert isinstance(a.forwards, int) and a.forwards >= 1 and a.wall_s > 0
  assert a.prompt_tokens == len(p)
  assert set(a.figures) == FIGURES[runtime]
  stop = int(a.finish_reason == "stop")
  if runtime in ("ar", "streaming_llm", "h2o", "tip"):
    assert a.forwards == len(a.token_ids) + stop           # one token per step
    assert a.tokens_per_forward == 1.0
    assert len(a.logprobs) == len(a.token_ids) and all(lp <= 0 for lp in a.logprobs)
  if runtime in ("ar", "streaming_llm", "h2o", "apar"):
    assert a.text == tok.decode(a.token_ids, skip_special_tokens=True)
  if runtime in ("streaming_llm", "h2o"):
    # the budget evicted: never more live tokens than the budget plus the one being written
    assert a.figures["peak_live_kv_tokens"] <= max(BUDGET + 1, len(p))
    assert a.figures["mean_live_kv_tokens"] < len(p) + len(a.token_ids)
  if runtime == "pasta":
    assert a.figures["threads"] == 3 and a.figures["max_parallel"] == 3
    assert a.tokens_per_forward > 1.0 and a.forwards < len(a.token_ids)
    assert a.tokens_per_forward == pytest.approx((len(a.token_ids) + stop) / a.forwards)
  if runtime == "apar":
    assert a.figures["forks"] >= 1 and a.figures["max_parallel"] >= 2
    assert a.tokens_per_forward == pytest.approx(a.figures["tokens"] / a.forwards)
    assert a.tokens_per_forward > 1.0
  if runtime == "sot":
    assert a.tokens_per_forward == pytest.approx(a.figures["tokens"] / a.forwards)
    assert a.figures["parsed"] == (a.figures["points"] > 0)
    assert a.text.startswith("1.") and a.token_ids == tok.encode(a.text)
    assert a.finish_reason == ("degraded" if not a.figures["parsed"] else a.finish_reason)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_stop_string_cuts_the_text(tiny, runtime):
  free, _ = _decode(tiny, runtime, n=16)
  cut = next((i for i, ch in enumerate(free.text)
              if ch.isascii() and ch.isprintable() and not ch.isspace()), None)
  assert cut is not None, free.text
  stop = free.text[cut]
  want = free.text[:free.text.index(stop)]
  a, _ = _decode(tiny, runtime, n=16, stop=[stop])
  assert a.text == want and stop not in a.text
  assert a.finish_reason == "stop"
  if runtime in ("ar", "streaming_llm", "h2o", "tip"):   # decoding itself stopped there
    assert len(a.token_ids) <= len(free.token_ids) and a.forwards <= free.forwards


def test_malformed_annotation_is_degraded(tiny):
  model, tok = tiny
  head = tok.encode_chat([{"role": "user", "content": "List three things."}])
  bad = {"pasta": head + [TV.promise_open, 80, 81, TV.promise_close, TV.async_open],  # no length
         "tip": head + [TV.promise_open, 80, TV.registers[0], 81]}       # a register in a promise
  for runtime, p in bad.items():
    a, = api.decode_ids(model, tok, [p], runtime=runtime, max_new_tokens=6, tag_vocab=TV)
    assert a.finish_reason == "degraded", runtime
    rule = "promise_without_length" if runtime == "pasta" else "tag_in_promise"
    assert any(n.endswith(rule) for n in a.figures["degraded"]), a.figures
    if runtime == "pasta":
      assert a.figures["well_formed"] is False
    good, = api.decode_ids(model, tok, [head], runtime=runtime, max_new_tokens=6, tag_vocab=TV)
    assert good.figures["degraded"] == [] and good.finish_reason == "length"


def test_finish_reason_rule_on_hand_made_parser_notes():
  length, stop = GenerationResult([5], [0.0], "length"), GenerationResult([5], [0.0], "stop")
  assert api._finish(length, []) == "length" and api._finish(stop, []) == "stop"
  # closing what was still open at max_new_tokens is the length cut, not a repair
  assert api._finish(length, ["end: unclosed_async", "end: forced_sync"]) == "length"
  assert api._finish(length, ["end: unclosed_async", "7: stray_tag"]) == "degraded"
  assert api._finish(stop, ["end: unclosed_async"]) == "degraded"
  assert api._finish(stop, ["12: promise_without_length"]) == "degraded"
  assert api._finish(GenerationResult([], [], "rounds"), []) == "stop"   # PASTA's max_rounds
  assert api._finish(GenerationResult([], [], "degraded"), []) == "degraded"   # SoT fallback


def test_errors(tiny):
  model, tok = tiny
  p = tok.encode("hi")
  with pytest.raises(api.ApiError, match="unknown runtime 'beam'"):
    api.decode_ids(model, tok, [p], runtime="beam")
  for runtime in ("pasta", "tip"):
    with pytest.raises(api.ApiError, match="orchestration tags"):
      api.decode_ids(model, tok, [p], runtime=runtime, tag_vocab=None)
  with pytest.raises(ValueError, match="none empty"):
    api.decode_ids(model, tok, [p, []])


@pytest.mark.parametrize("runtime", api.SPECULATIVE_RUNTIMES)
def test_speculative_runtimes_through_the_api_equal_ar(tiny, runtime):
  """PTD / PLD / Lookahead / Orthrus through decode_ids: the same tokens and text as AR greedy
  (lossless), their own forward count and acceptance figures. Orthrus runs the tiny model with an
  (untrained) diffusion view added."""
  model, tok = tiny
  if runtime == "orthrus":
    model, _ = add_orthrus(model)
  prompts = [tok.encode("ab ab ab ab ab ab ab ab"), tok.encode("xyz xyz xyz xyz")]
  ar_rows = api.decode_ids(model, tok, prompts, runtime="ar", max_new_tokens=24)
  rows = api.decode_ids(model, tok, prompts, runtime=runtime, max_new_tokens=24)
  for a, b in zip(ar_rows, rows):
    assert b.token_ids == a.token_ids and b.text == a.text
    assert b.finish_reason == a.finish_reason
    per_step = 2 if runtime == "orthrus" else 1     # Orthrus: a diffusion and a verify pass
    assert 1 <= b.forwards <= per_step * (len(b.token_ids) + 1)
    assert b.tokens_per_forward == pytest.approx(len(b.token_ids) / b.forwards)
    assert b.figures["mean_accepted"] >= 0.0


def test_orthrus_denoise_steps_option_through_the_api(tiny):
  """``options={"denoise_steps": 2}`` reaches the Orthrus scheduler: the same tokens as AR, and
  two diffusion passes per block of >= 2 drafts (more diffusion than verify forwards)."""
  model, tok = tiny
  model, _ = add_orthrus(model)
  prompts = [tok.encode("ab ab ab ab ab ab ab ab")]
  a = api.decode_ids(model, tok, prompts, runtime="ar", max_new_tokens=20)[0]
  o = api.decode_ids(model, tok, prompts, runtime="orthrus", max_new_tokens=20,
                     options={"denoise_steps": 2})[0]
  assert o.token_ids == a.token_ids
  assert o.figures["diffusion_forwards"] > o.figures["verify_forwards"]
