"""PASTA annotators (issue 5, data and annotation): the rule-based annotator on hand-pinned cases
and on the real Alpaca responses, the LLM annotator against a local OpenAI-compatible server, and
the annotation report's figures."""

import json
import math

import pytest

from selforch_jax.data import sources
from selforch_jax.lang import Degraded, Promise, Round, add_tags, assemble_text, parse, serialize
from selforch_jax.lang.annotators import Annotation, annotator_names, get_annotator
from selforch_jax.lang.annotators.pasta_rules import PastaRulesAnnotator, find_rounds, topic_of
from selforch_jax.lang.annotators.report import annotation_report, measure_pasta
from reference_decode import ReferenceDecoder


@pytest.fixture(scope="module")
def tok_tv():
  from selforch_jax import config_lib
  tok = config_lib.load_tokenizer("smollm2_gguf")  # make test installs the GGUF: a missing one fails
  tv = add_tags(tok)
  return tok, tv


@pytest.fixture(scope="module")
def rules(tok_tv):
  return get_annotator("pasta_rules", tokenizer=tok_tv[0])


def _clean(text, tok, tv):
  ids = tok.encode(text)
  return [e.rule for e in parse(ids, tv) if isinstance(e, Degraded)], assemble_text(ids, tv, tok)


NUMBERED = ("Here are three tips:\n1. Sleep well every night.\n"
            "2. Eat vegetables with every meal, because fibre, vitamins and minerals keep the body "
            "healthy and the mind sharp for the whole long working day.\n"
            "3. Exercise daily.\n\nGood luck!")


def test_registered():
  assert "pasta_rules" in annotator_names() and "pasta_llm" in annotator_names()


def test_numbered_list_exact_canonical_form(tok_tv, rules):
  tok, tv = tok_tv
  a = rules.annotate("Give me tips.", NUMBERED)
  c1 = "1. Sleep well every night.\n"
  c2 = NUMBERED.split("\n")[2] + "\n"
  c3 = "3. Exercise daily."
  n = [math.ceil(len(tok.encode(c)) / 10) for c in (c1, c2, c3)]
  assert n[1] >= 2 and n[0] == n[2] == 1
  assert a.text == (f"Here are three tips:\n<promise>Sleep well every night {n[0]}</promise>"
                    f"<promise>Eat vegetables with every meal {n[1]}</promise>"
                    f"<promise>Exercise daily {n[2]}</promise>"
                    f"<async>{c1}</async><async>{c2}</async><async>{c3}</async><sync/>"
                    "\n\nGood luck!")
  assert a.info["chunks"] == 3 and a.info["lengths"] == n
  assert a.info["chunk_tokens"] == [len(tok.encode(c)) for c in (c1, c2, c3)]
  # the text tokenizes to exactly what the language's serializer writes for this structure
  enc = tok.encode
  want = serialize([*enc("Here are three tips:\n"),
                    Round(plan=tuple(Promise(tuple(enc(t)), k) for t, k in zip(
                        ("Sleep well every night", "Eat vegetables with every meal",
                         "Exercise daily"), n)),
                          chunks=tuple(tuple(enc(c)) for c in (c1, c2, c3))),
                    *enc("\n\nGood luck!")], tv)
  assert tok.encode(a.text) == want
  degraded, text = _clean(a.text, tok, tv)
  assert degraded == [] and text == NUMBERED


def test_whitespace_word_estimate_without_tokenizer():
  a = PastaRulesAnnotator().annotate("", NUMBERED)
  words = [len(NUMBERED.split("\n")[i].split()) for i in (1, 2, 3)]
  est = [math.ceil(1.3 * w) for w in words]
  assert a.info["chunk_tokens"] == est and a.info["estimated"] is True
  assert a.info["lengths"] == [math.ceil(e / 10) for e in est]


def test_markdown_sections(tok_tv, rules):
  tok, tv = tok_tv
  resp = ("Two sides to this.\n\n## Benefits of remote work\nNo commute and flexible hours.\n\n"
          "## Risks\n- isolation\n- blurred boundaries\n")
  a = rules.annotate("Remote work?", resp)
  assert a.text is not None and a.info["chunks"] == 2 and a.info["rounds"] == 1
  s1, s2 = "## Benefits of remote work\nNo commute and flexible hours.\n\n", \
      "## Risks\n- isolation\n- blurred boundaries"
  n = [math.ceil(len(tok.encode(c)) / 10) for c in (s1, s2)]
  assert a.text == (f"Two sides to this.\n\n<promise>Benefits of remote work {n[0]}</promise>"
                    f"<promise>Risks {n[1]}</promise><async>{s1}</async><async>{s2}</async>"
                    "<sync/>\n")
  degraded, text = _clean(a.text, tok, tv)
  assert degraded == [] and text == resp


def test_items_that_refer_to_each_other(rules):
  dep = ("1. Preheat the oven to 200 C.\n2. Then put the tray in it.\n"
         "3. After that, wait until the step 2 tray is golden.")
  a = rules.annotate("Bake.", dep)
  assert a.text is None and a.info["reason"] == "fewer than 2 independent items"
  # a referring item joins the chunk before it; the rest stay parallel
  part = "- Apples are sweet.\n- They are also cheap.\n- Pears are juicy."
  rounds = find_rounds(part)
  assert [part[i.start:i.end] for i in rounds[0]] == \
      ["- Apples are sweet.\n- They are also cheap.\n", "- Pears are juicy."]
  # after a header, "This ..." refers to the header, not a sibling
  hdr = "1. Caching: This saves time.\n2. Batching: This saves memory."
  assert len(find_rounds(hdr)[0]) == 2


def test_no_list_and_tag_text(rules):
  assert rules.annotate("", "Paris is the capital of France.").text is None
  assert rules.annotate("", "1. only one item").text is None
  assert rules.annotate("", "").info["reason"] == "empty response"
  a = rules.annotate("", "- use <sync/> here\n- and there")
  assert a.text is None and a.info["reason"] == "response contains tag text"


def test_weird_whitespace_and_unicode(tok_tv, rules):
  tok, tv = tok_tv
  resp = ("Voilà\u00a0:\r\n• Café crème,  très\tbon 😀\r\n• Naïve façade — 東京\r\n\r\n"
          "   • nested-looking but same list?\r\n\r\nFin.\u2028done")
  a = rules.annotate("", resp)
  assert a.text is not None and a.info["chunks"] >= 2
  assert a.text.startswith("Voilà\u00a0:\r\n<promise>Café crème très bon ")
  degraded, text = _clean(a.text, tok, tv)
  assert degraded == [] and text == resp
  # a numbered list with unindented paragraphs inside items (next number follows)
  lazy = "Intro\n1. First\nbody one\n\n2. Second\nbody two\n\nOutro"
  r = find_rounds(lazy)
  # (the last item has no next number, so its unindented line is the continuation)
  assert [lazy[i.start:i.end] for i in r[0]] == ["1. First\nbody one\n\n", "2. Second"]


def test_topic_rules():
  assert topic_of("**Exercise regularly**: walk a lot", 0) == "Exercise regularly"
  assert topic_of("Time management: plan the week", 0) == "Time management"
  assert topic_of("equals - checks if two values", 0) == "equals"
  assert topic_of("one two three four five six seven", 0) == "one two three four five"
  assert topic_of("🙂 🙂", 2) == "item 3"


def test_round_trip_on_real_alpaca(tok_tv, rules):
  tok, tv = tok_tv
  exs = sources.load_examples("alpaca")
  annotated = 0
  for ex in exs:
    user, resp = ex["messages"][0]["content"], ex["messages"][1]["content"]
    a = rules.annotate(user, resp)
    if a.text is None:
      continue
    annotated += 1
    ids = tok.encode(a.text)
    assert not [e for e in parse(ids, tv) if isinstance(e, Degraded)], a.text
    out = assemble_text(ids, tv, tok)
    assert out.split() == resp.split()
    assert out == resp
    m = measure_pasta(a.text, tok, tv)
    assert m["chunks"] == a.info["chunks"] >= 2 and m["lengths"] == a.info["lengths"]
    assert all(10 * n >= t > 10 * (n - 1) for n, t in zip(m["lengths"], m["chunk_tokens"]))
  assert annotated >= 200


def test_report_figures_by_hand():
  anns = [
      Annotation("x", {"lengths": [2, 3], "chunk_tokens": [15, 30], "rounds": 1}),
      Annotation("y", {"lengths": [1, 1, 4], "chunk_tokens": [10, 5, 50], "rounds": 2}),
      Annotation(None, {"reason": "fewer than 2 independent items"}),
      Annotation(None, {"rejected": "words: changed"}),
  ]
  r = annotation_report(anns)
  assert r["n"] == 4 and r["annotated"] == 2 and r["fraction_annotated"]["mean"] == 0.5
  assert r["chunks"] == 5 and r["rounds"] == 3
  assert r["chunks_per_annotated"]["mean"] == 2.5 and r["chunks_per_annotated"]["n"] == 2
  # |10N - t| = 5, 0, 0, 5, 10 -> 4; relative 5/15, 0, 0, 1, 10/50
  assert r["length_abs_error_tokens"]["mean"] == pytest.approx(4.0)
  assert r["length_rel_error"]["mean"] == pytest.approx((1 / 3 + 1 + 0.2) / 5)
  lo, hi = r["length_abs_error_tokens"]["lo"], r["length_abs_error_tokens"]["hi"]
  assert 0 <= lo <= 4 <= hi <= 10
  assert r["reasons"] == {"fewer than 2 independent items": 1, "words": 1}
  json.dumps(r)
  with pytest.raises(ValueError):
    annotation_report([])


# ---- LLM annotator -------------------------------------------------------------------------------

@pytest.fixture
def fake_endpoint():
  """A local OpenAI-compatible chat endpoint returning canned replies; records the requests."""
  import http.server
  import threading

  state = {"replies": [], "requests": []}

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server hook
      body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
      state["requests"].append({"path": self.path, "auth": self.headers.get("Authorization"),
                                "body": body})
      reply = state["replies"].pop(0)
      if isinstance(reply, int):
        self.send_response(reply)
        self.end_headers()
        return
      data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]})
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.end_headers()
      self.wfile.write(data.encode())

    def log_message(self, *a):
      pass

  srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
  th = threading.Thread(target=srv.serve_forever, daemon=True)
  th.start()
  state["base_url"] = f"http://127.0.0.1:{srv.server_address[1]}/v1"
  yield state
  srv.shutdown()
  srv.server_close()


def test_llm_annotator_against_local_endpoint(tok_tv, rules, fake_endpoint):
  from selforch_jax.lang.annotators.pasta_llm import LANGUAGE
  tok, tv = tok_tv
  good = rules.annotate("", NUMBERED).text
  changed = good.replace("Exercise daily.", "Exercise weekly.")
  unclosed = good.replace("</async><sync/>", "")
  fenced = "```\n" + good + "\n```"
  fake_endpoint["replies"] = [good, changed, unclosed, 500, fenced, NUMBERED]
  llm = get_annotator("pasta_llm", tokenizer=tok, base_url=fake_endpoint["base_url"],
                      model="annotator-x", api_key="k123")
  a = llm.annotate("Give me tips.", NUMBERED)
  assert a.text == good and a.info["chunks"] == 3 and a.info["lengths"] == rules.annotate(
      "", NUMBERED).info["lengths"]
  req = fake_endpoint["requests"][0]
  assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer k123"
  msgs = req["body"]["messages"]
  assert req["body"]["model"] == "annotator-x"
  assert msgs[0] == {"role": "system", "content": LANGUAGE}
  assert len(msgs) == 1 + 2 * 3 + 1 and NUMBERED in msgs[-1]["content"]
  assert "Give me tips." in msgs[-1]["content"]
  r = llm.annotate("", NUMBERED)   # a word changed
  assert r.text is None and r.info["rejected"].startswith("words: changed at word")
  r = llm.annotate("", NUMBERED)   # last chunk never closed, no join
  assert r.text is None and r.info["rejected"].startswith("parse:")
  r = llm.annotate("", NUMBERED)   # HTTP 500
  assert r.text is None and r.info["rejected"].startswith("backend: RuntimeError: HTTP 500")
  assert llm.annotate("", NUMBERED).text == good   # code fence removed
  r = llm.annotate("", NUMBERED)   # the response given back unchanged
  assert r.text is None and r.info == {"reason": "no round"}
  assert len(fake_endpoint["requests"]) == 6


def test_llm_examples_are_valid_and_unreachable_endpoint(tok_tv):
  from selforch_jax.lang.annotators.pasta_llm import EXAMPLES, ChatBackend, PastaLLMAnnotator

  class Echo(ChatBackend):
    def complete(self, messages):
      return messages[-1]["content"]

  llm = PastaLLMAnnotator(tok_tv[0], backend=Echo())
  for _, resp, ann in EXAMPLES[:2]:
    a = llm.validate(resp, ann)
    assert a.text == ann and a.info["chunks"] == 3
    assert a.info["lengths"] == [math.ceil(t / 10) for t in a.info["chunk_tokens"]]
  assert llm.validate(EXAMPLES[2][1], EXAMPLES[2][2]).info == {"reason": "no round"}
  dead = get_annotator("pasta_llm", tokenizer=tok_tv[0], base_url="http://127.0.0.1:9/v1",
                       model="m")
  r = dead.annotate("", NUMBERED)
  assert r.text is None and r.info["rejected"].startswith("backend:")
  with pytest.raises(ValueError, match="tokenizer"):
    PastaLLMAnnotator(None, backend=Echo())


def test_llm_engine_backend_is_our_greedy_decode(tok_tv):
  """The engine backend's reply is the greedy continuation of the chat-templated prompt
  (checked against an uncached reference decode on a toy-width model with the real tokenizer)."""
  from selforch_jax.lang.annotators.pasta_llm import EngineChatBackend, PastaLLMAnnotator
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model
  tok, tv = tok_tv
  model = init_model(get_preset("tiny_smollm2", vocab_size=tok.vocab_size), 0)
  backend = EngineChatBackend(model, tok, max_new_tokens=6, page_size=64)
  msgs = [{"role": "user", "content": "Name two colors."}]
  reply = backend.complete(msgs)
  ids = tok.encode_chat(msgs, add_generation_prompt=True)
  ref, _ = ReferenceDecoder(model).generate([ids], max_new_tokens=6, stop_ids=tok.stop_ids)
  assert reply == tok.decode(ref[0].token_ids) and len(ref[0].token_ids) >= 1
  # a random model's rewrite is rejected (its words are not the response's), never raised
  llm = PastaLLMAnnotator(tok, backend=backend)
  a = llm.validate(NUMBERED, reply)
  assert a.text is None and a.info["rejected"].startswith(("words:", "parse:"))
