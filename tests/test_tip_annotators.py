"""TIP register allocation (lang.registers) and the TIP annotators (tip_gsm8k, tip_llm).

Expected registers in the hand-drawn graphs are derived from the rules in
``selforch_jax/lang/registers.py`` by hand (written in the comments), not from the code.
"""

from __future__ import annotations

import http.server
import json
import pathlib
import re
import threading

import pytest

from selforch_jax.lang import Degraded, RegisterUse, assemble_text, parse
from selforch_jax.lang.annotators import get_annotator
from selforch_jax.lang.annotators.tip_gsm8k import gsm8k_dependences, split_steps
from selforch_jax.lang.annotators.tip_llm import (
  EngineBackend, GraphParseError, OpenAIChatBackend, parse_graph,
)
from selforch_jax.lang.registers import (
  RegisterPressureError, check_allocation, kills, last_uses, linear_scan, max_live, tag_steps,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
TAG = re.compile(r"<reg_\d+>")


def _rows(n):
  with open(REPO / "data/gsm8k/train.jsonl", encoding="utf-8") as f:
    return [json.loads(next(f)) for _ in range(n)]


# --- linear scan on hand-drawn graphs -----------------------------------------------------------

# Graph A: 0 -> {2}, 1 -> {3}, 2 -> {3}, 3 -> {4}; step 4 (answer) kept.
#   last uses: 0:2, 1:3, 2:3, 3:4, 4:n=5.
#   s0 fresh r0; s1 fresh r1; s2 (step 0 still live at 2) fresh r2;
#   s3: step 0 ended (2 < 3) -> r0 holds a dead step -> reuse r0, kills step 0;
#   s4: steps 1, 2 ended at 3 -> r1, r2 dead since 3; lowest index r1 -> kills step 1.
GRAPH_A = [[], [], [0], [1, 2], [3]]


def test_linear_scan_graph_a():
  a = linear_scan(GRAPH_A, 8, keep=[4])
  assert a.last_use == (2, 3, 3, 4, 5)
  assert a.registers == (0, 1, 2, 0, 1)
  assert a.killed_by == (3, 4, None, None, None)
  assert a.evicted == (0, 1)
  assert a.max_live == 3            # at step 2: steps 0, 1, 2
  assert a.resident == (1, 2, 3, 3, 3)
  assert a.merged == ()
  assert check_allocation(GRAPH_A, a.registers, keep=[4], num_registers=8) == []


def test_unused_step_dies_right_after_it_is_written():
  # Graph B: step 0 is never used -> last use 0 -> step 1 may reuse r0 (kills step 0);
  # step 1 -> {2}, step 2 -> {3}, step 3 kept.
  #   s0 r0; s1: r0 dead -> r0 (kills 0); s2: step 1 live (last use 2) -> fresh r1;
  #   s3: step 1 ended at 2 -> r0 dead -> r0 (kills 1).
  uses = [[], [], [1], [2]]
  a = linear_scan(uses, 4, keep=[3])
  assert a.last_use == (0, 2, 3, 4)
  assert a.registers == (0, 0, 1, 0)
  assert a.killed_by == (1, 3, None, None)


def test_prefer_dead_register_that_died_first():
  # steps 0, 1, 2 used only by step 3 and step 4 respectively:
  # 0 -> {3} (dies at 3), 1 -> {2} (dies at 2), 2 -> {4}, 3, 4 kept.
  #   s0 r0, s1 r1, s2 fresh r2 (0 and 1 live at 2); s3: step 1 dead (2 < 3) -> r1, kills 1;
  #   s4: step 0 dead since 3 -> r0 (kills 0), step 2 still used at 4.
  uses = [[], [], [1], [0], [2]]
  a = linear_scan(uses, 8, keep=[3, 4])
  assert a.registers == (0, 1, 2, 1, 0)
  assert a.killed_by == (4, 3, None, None, None)


def test_k_too_small_merges_and_reject_raises():
  # Graph A with K = 2: s0 r0, s1 r1, s2: both live (ends 2, 3) -> merged into step 1's group
  # (no tag; group end max(3, 3) = 3); s3: step 0 dead -> r0 (kills 0);
  # s4: group {1, 2} dead since 3 -> r1 kills steps 1 and 2.
  a = linear_scan(GRAPH_A, 2, keep=[4])
  assert a.registers == (0, 1, None, 0, 1)
  assert a.merged == (2,)
  assert a.killed_by == (3, 4, 4, None, None)
  assert check_allocation(GRAPH_A, a.registers, keep=[4], num_registers=2) == []
  assert max(a.resident) <= 3
  with pytest.raises(RegisterPressureError, match="K=2"):
    linear_scan(GRAPH_A, 2, keep=[4], spill="reject")
  # K = 1 on a chain: every later step stays in register 0's step, nothing is ever killed.
  one = linear_scan([[], [0], [1]], 1, keep=[2])
  assert one.registers == (0, None, None) and one.evicted == ()


def test_register_helpers_and_errors():
  assert last_uses([[], [0], [0]]) == (2, 1, 2)
  assert max_live((2, 1, 2)) == 2   # s=1: steps 0, 1; s=2: steps 0, 2 (step 1 ended at 1)
  assert kills([0, None, 1, 0]) == (3, 3, None, None)   # the untagged step dies with its group
  # a wrong assignment is caught: step 1 kills step 0 (register 0) but steps 1, 2 use it
  errs = check_allocation([[], [0], [0]], [0, 0, 1])
  assert len(errs) == 2 and "step 0 is killed by step 1" in errs[0]
  assert check_allocation([[], [0]], [0, 0], keep=[0]) != []
  with pytest.raises(ValueError, match="only use earlier"):
    linear_scan([[], [1]], 2)
  with pytest.raises(ValueError):
    linear_scan([[]], 0)
  assert tag_steps(["a\n", "b\n", "c"], [0, None, 1]) == "<reg_0>a\nb\n<reg_1>c"


# --- GSM8K annotator on real rows -----------------------------------------------------------------


def test_gsm8k_first_rows_hand_checked():
  r = _rows(3)
  ann = get_annotator("tip_gsm8k", num_registers=8)
  # Natalia: line 1 makes 24; line 2 uses 24 (48 is from the question) and makes 72; #### 72.
  out = ann.annotate(r[0]["question"], r[0]["answer"])
  assert out.info["uses"] == [[], [0], [1]]
  assert out.text == ("<reg_0>Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                      "<reg_1>Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
                      "<reg_0>#### 72")
  assert out.info["evicted"] == [0]
  # Betty: 50 and 30 are both used by line 3, which makes 5, used by ####.
  out = ann.annotate(r[2]["question"], r[2]["answer"])
  assert out.info["uses"] == [[], [], [0, 1], [2]]
  assert out.info["registers"] == [0, 1, 2, 0] and out.info["max_live"] == 3
  # with K = 2 line 3 has no free register: it joins line 2's step (no tag)
  small = get_annotator("tip_gsm8k", num_registers=2).annotate(r[2]["question"], r[2]["answer"])
  assert small.info["registers"] == [0, 1, None, 0] and small.info["merged"] == [2]
  rej = get_annotator("tip_gsm8k", num_registers=2, spill="reject").annotate(
    r[2]["question"], r[2]["answer"])
  assert rej.text is None and "registers" in rej.info["rejected"]
  assert ann.annotate("q", "no final line here").text is None


@pytest.fixture(scope="module")
def smollm2_tags():
  from selforch_jax import config_lib
  from selforch_jax.lang.tags import add_tags
  tok = config_lib.load_tokenizer("smollm2_gguf")
  return tok, add_tags(tok, None, 8)


def test_gsm8k_annotations_parse_strip_and_kill_only_dead_steps(smollm2_tags):
  tok, tv = smollm2_tags
  rows = _rows(300)
  ann = get_annotator("tip_gsm8k", num_registers=8)
  n_killed = 0
  for row in rows:
    out = ann.annotate(row["question"], row["answer"])
    assert out.text is not None
    assert TAG.sub("", out.text) == row["answer"]              # stripping tags: the solution
    ids = tok.encode(out.text)
    assert assemble_text(ids, tv, tok) == row["answer"]        # ... also through the language
    events = parse(ids, tv)
    assert not [e for e in events if isinstance(e, Degraded)]
    # token index -> step: steps start at their tag (untagged merged steps continue the last one)
    step_of, s = {}, -1
    for e in events:
      if isinstance(e, RegisterUse):
        s += 1
        while out.info["registers"][s] is None:
          s += 1
      if e.index is not None:
        step_of[e.index] = s
    uses = out.info["uses"]
    last = [max([j for j, u in enumerate(uses) if i in u], default=i) for i in range(len(uses))]
    killed_steps = set()
    for e in events:
      if isinstance(e, RegisterUse) and e.killed:
        j = step_of[e.index]
        for i in {step_of[k] for k in e.killed}:
          assert last[i] < j, (row["answer"], i, j)            # no later use of a killed step
          killed_steps.add(i)
    assert killed_steps == set(out.info["evicted"])            # the parser kills what the allocator said
    final = len(uses) - 1
    assert final not in killed_steps and "####" in split_steps(row["answer"])[final]
    n_killed += len(killed_steps)
  assert n_killed > len(rows)  # most solutions evict something (measured: ~1.9 steps per row)


def test_gsm8k_dependences_match_values_not_question_numbers():
  q = "Tom has 3 boxes of 12 pens. He gives away 5 pens."
  steps = split_steps("Tom has 3*12=<<3*12=36>>36 pens.\nHe keeps 36-5=<<36-5=31>>31.\n\n#### 31")
  uses, final = gsm8k_dependences(q, steps)
  assert steps[1].endswith("\n\n") and final == 2   # the blank line joins the step before it
  assert uses == [set(), {0}, {1}]
  # a number stated without a calculator annotation and not in the question is a product too
  steps = split_steps("A dozen is 12, so 2 dozen is 24 eggs.\nShe uses 24-4=<<24-4=20>>20.\n#### 20")
  assert gsm8k_dependences("She has 2 dozen eggs and uses 4.", steps)[0] == [set(), {0}, {1}]


# --- LLM annotator ------------------------------------------------------------------------------


def test_parse_graph_robust_and_strict():
  assert parse_graph('```json\n{"1": [], "2": [1], "3": ["1", "step 2"]}\n```', 3) == \
    [set(), {0}, {0, 1}]
  assert parse_graph("Sure! [[], [1], [2]] hope this helps", 3) == [set(), {0}, {1}]
  assert parse_graph('{"3": [2]}', 3) == [set(), set(), {1}]   # missing steps use nothing
  for bad in ('{"2": [2]}', '{"2": [3]}', '{"9": []}', "no json", '{"2": [true]}'):
    with pytest.raises(GraphParseError):
      parse_graph(bad, 3)


class _FakeOpenAI(http.server.BaseHTTPRequestHandler):
  reply = ""
  seen: list = []

  def do_POST(self):  # noqa: N802 - http.server API
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    type(self).seen.append((self.path, body, self.headers.get("Authorization")))
    out = json.dumps({"choices": [{"message": {"role": "assistant", "content": type(self).reply}}]})
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.end_headers()
    self.wfile.write(out.encode())

  def log_message(self, *a):
    pass


@pytest.fixture()
def fake_endpoint():
  srv = http.server.HTTPServer(("127.0.0.1", 0), _FakeOpenAI)
  th = threading.Thread(target=srv.serve_forever, daemon=True)
  th.start()
  _FakeOpenAI.seen = []
  yield f"http://127.0.0.1:{srv.server_port}/v1"
  srv.shutdown()
  srv.server_close()


def test_llm_annotator_over_openai_endpoint(fake_endpoint, monkeypatch):
  row = _rows(3)[2]
  monkeypatch.setenv("TIP_TEST_KEY", "sk-test")
  _FakeOpenAI.reply = 'The graph:\n```json\n{"1": [], "2": [], "3": [1, 2], "4": [3]}\n```'
  ann = get_annotator("tip_llm", base_url=fake_endpoint, model="judge", api_key_env="TIP_TEST_KEY")
  out = ann.annotate(row["question"], row["answer"])
  rule = get_annotator("tip_gsm8k").annotate(row["question"], row["answer"])
  assert out.text == rule.text                      # the same graph gives the same tags
  path, body, auth = _FakeOpenAI.seen[0]
  assert path == "/v1/chat/completions" and body["model"] == "judge" and auth == "Bearer sk-test"
  assert "Step 3: This means, Betty needs" in body["messages"][0]["content"]
  _FakeOpenAI.reply = '{"2": [3]}'                  # invalid graph -> rejected, never raises
  bad = ann.annotate(row["question"], row["answer"])
  assert bad.text is None and "not an earlier step" in bad.info["rejected"]


def test_llm_annotator_backend_failure_is_rejection():
  dead = OpenAIChatBackend("http://127.0.0.1:9/v1", "m", timeout=2)
  out = get_annotator("tip_llm", backend=dead).annotate("q", "a = 1\n#### 1")
  assert out.text is None and out.info["rejected"].startswith("backend error")
  with pytest.raises(ValueError, match="backend"):
    get_annotator("tip_llm")


def test_llm_annotator_with_engine_backend_tiny_model(smollm2_tags):
  """Our engine as the backend: a random tiny model's reply is garbage -> a rejection (no raise),
  and the reply is kept in info; the engine did decode max_new_tokens tokens or stopped."""
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model
  tok, _ = smollm2_tags
  model = init_model(get_preset("tiny_smollm2", vocab_size=tok.vocab_size), 0)
  backend = EngineBackend(model, tok, max_new_tokens=6, page_size=16)
  row = _rows(1)[0]
  out = get_annotator("tip_llm", backend=backend).annotate(row["question"], row["answer"])
  assert isinstance(out.info.get("reply"), str)
  if out.text is None:
    assert out.info["rejected"]
  else:  # a random model producing a valid graph is astronomically unlikely, but would be valid
    assert TAG.sub("", out.text) == row["answer"]
