"""Planned Diffusion records from PASTA-annotated chat data (issue 21): promise lengths rewritten
to ceil(chunk tokens / 10), [PAD] per chunk within the 10*N scaffold, <sync/> before continuation
text, rows without a plan dropped or kept, malformed rows dropped, the cache file, and the config's
``data=chat`` key (the chat cache in the workdir, ConfigError for a bad value). Tokenizer-free: a
whitespace word count stands in for the tokenizer."""

import json
import math
import os

import pytest

from selforch_jax import config_lib
from selforch_jax.data.planned_diffusion_data import (MAX_PAD, _pieces, chat_pd_records,
                                                      ensure_chat_pd_data)
from selforch_jax.lang.tags import ASYNC_CLOSE, ASYNC_OPEN, PAD, SYNC

WORDS = lambda text: len(text.split())   # noqa: E731


def _row(answer, prompt="Q?"):
  return {"messages": [{"role": "user", "content": prompt},
                       {"role": "assistant", "content": answer}],
          "source": "alpaca", "annotated": "<promise>" in answer}


def _chunks(text):
  """(chunk body without [PAD], number of [PAD]) per chunk."""
  out = []
  for seg in text.split(ASYNC_OPEN)[1:]:
    body = seg.split(ASYNC_CLOSE)[0]
    out.append((body.replace(PAD, ""), body.count(PAD)))
  return out


def test_lengths_rewritten_pads_capped_and_sync_added():
  c1 = " ".join(["w"] * 23)      # 23 words -> N = 3
  c2 = " ".join(["v"] * 10)      # 10 words -> N = 1 (scaffold full: no room for [PAD])
  ans = (f"Intro <promise>A one 1</promise><promise>B two 9</promise>"
         f"<async>{c1}</async><async>{c2}</async> and a continuation.")
  recs, st = chat_pd_records([_row(ans)], WORDS, seed=0)
  assert len(recs) == 1 and st["kept"] == 1 and st["n_changed"] == 2
  text = recs[0]["messages"][1]["content"]
  assert text.startswith("Intro <promise>A one 3</promise><promise>B two 1</promise><async>")
  (b1, p1), (b2, p2) = _chunks(text)
  assert (b1, b2) == (c1, c2)
  assert 0 <= p1 <= 30 - 23 and p2 == 0          # capped: padded chunk <= 10*N
  assert text.endswith(ASYNC_CLOSE + SYNC + " and a continuation.")
  assert st["sync_added"] == 1 and st["rounds"] == 1 and st["chunks"] == 2
  assert recs[0]["annotated"] is True and recs[0]["chunks"] == 2
  assert recs[0]["messages"][0] == {"role": "user", "content": "Q?"}


def test_pad_counts_in_range_vary_and_are_seeded():
  body = " ".join(["x"] * 3)     # N = 1, room for 7 [PAD]
  ans = "<promise>t 1</promise>" * 4 + f"{ASYNC_OPEN}{body}{ASYNC_CLOSE}" * 4 + SYNC
  rows = [_row(ans) for _ in range(30)]
  recs, st = chat_pd_records(rows, WORDS, seed=5)
  pads = [p for r in recs for _, p in _chunks(r["messages"][1]["content"])]
  assert len(pads) == 120 and all(0 <= p <= 7 for p in pads) and len(set(pads)) >= 5
  assert st["pads"] == sum(pads) and st["sync_added"] == 0    # the <sync/> was there already
  assert all(r["messages"][1]["content"].endswith(ASYNC_CLOSE + SYNC) for r in recs)
  again, _ = chat_pd_records(rows, WORDS, seed=5)
  other, _ = chat_pd_records(rows, WORDS, seed=6)
  assert again == recs and other != recs
  # uncapped: upstream's 0..MAX_PAD; pad=False: none
  unc, _ = chat_pd_records(rows, WORDS, seed=5, cap_pad=False)
  up = [p for r in unc for _, p in _chunks(r["messages"][1]["content"])]
  assert max(up) > 7 and max(up) <= MAX_PAD
  nop, st0 = chat_pd_records(rows, WORDS, seed=5, pad=False)
  assert st0["pads"] == 0 and PAD not in nop[0]["messages"][1]["content"]


def test_two_rounds_get_a_sync_between_and_end_round_is_left():
  ans = ("<promise>a 5</promise><async>one two</async>"
         "<promise>b 5</promise><async>three</async>")
  recs, st = chat_pd_records([_row(ans)], WORDS, seed=0, pad=False)
  assert recs[0]["messages"][1]["content"] == (
      "<promise>a 1</promise><async>one two</async><sync/>"
      "<promise>b 1</promise><async>three</async>")
  assert st["rounds"] == 2 and st["sync_added"] == 1


def test_plain_rows_dropped_or_kept_and_malformed_dropped():
  plain = _row("Just an answer.")
  bad = [_row("<promise>a 1</promise><promise>b 1</promise><async>x</async><sync/>"),  # 2 vs 1
         _row("<promise>a</promise><async>x</async>"),                                # no N
         _row("<promise>a 1</promise><async>x <sync/> y</async>"),                     # nested
         _row("<promise>a 1</promise> text <async>x</async>")]                        # plan text
  good = _row("<promise>a 1</promise><async>x</async><sync/>")
  recs, st = chat_pd_records([plain, *bad, good], WORDS, seed=0)
  assert len(recs) == 1 and st["plain_dropped"] == 1 and st["malformed"] == 4
  kept, st2 = chat_pd_records([plain, good], WORDS, seed=0, keep_plain=True)
  assert [r["annotated"] for r in kept] == [False, True] and st2["plain_kept"] == 1
  assert kept[0]["messages"] == plain["messages"]


def test_pieces_split_on_tags():
  assert _pieces("a<promise>b 1</promise><async>c[PAD]</async><sync/>d") == [
      "a", "<promise>", "b 1", "</promise>", "<async>", "c", "[PAD]", "</async>", "<sync/>", "d"]


def test_ensure_chat_pd_data_caches(tmp_path):
  src = tmp_path / "src.jsonl"
  rows = [_row("<promise>a 4</promise><async>one two three</async><sync/> done"),
          _row("plain")]
  src.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = str(tmp_path / "w" / "pd.jsonl")
  assert ensure_chat_pd_data(out, WORDS, src=str(src), seed=1) == out
  recs = [json.loads(x) for x in open(out)]
  assert len(recs) == 1 and "<promise>a 1</promise>" in recs[0]["messages"][1]["content"]
  meta = json.load(open(out + ".meta.json"))
  assert meta["stats"]["kept"] == 1 and meta["stats"]["plain_dropped"] == 1
  mtime = os.path.getmtime(out)
  ensure_chat_pd_data(out, WORDS, src=str(src), seed=1)        # same arguments: not rewritten
  assert os.path.getmtime(out) == mtime
  (tmp_path / "plain.jsonl").write_text(json.dumps(rows[1]) + "\n")
  with pytest.raises(ValueError, match="no Planned Diffusion record"):
    ensure_chat_pd_data(str(tmp_path / "x.jsonl"), WORDS, src=str(tmp_path / "plain.jsonl"))


def test_config_data_key(tmp_path):
  from selforch_jax.trainers.planned_diffusion_run import CHAT_CACHE_FILE, data_section, validate_pd
  c = config_lib.load_config_file("configs/planned_diffusion.py:pd,data=chat,steps=3,batch_size=2")
  assert c.planned_diffusion.source == "chat" and c.data.chunk_bidirectional is True
  validate_pd(c)
  assert data_section(c, str(tmp_path))["path"] == os.path.join(str(tmp_path), CHAT_CACHE_FILE)
  assert config_lib.load_config_file("configs/planned_diffusion.py").planned_diffusion.source == "cities"
  with pytest.raises(config_lib.ConfigError, match="data="):
    config_lib.load_config_file("configs/planned_diffusion.py:pd,data=slimorca")
  c.planned_diffusion.source = "bogus"
  with pytest.raises(config_lib.ConfigError, match="planned_diffusion.source"):
    validate_pd(c)
  c2 = config_lib.load_config_file("configs/planned_diffusion.py:pasta,data=chat")
  with pytest.raises(config_lib.ConfigError, match="source='chat'"):
    validate_pd(c2)


def test_chat_stage_writes_the_records(tmp_path):
  """What build_pd does before the model: the chat cache from the PASTA file (the first rows)."""
  src = tmp_path / "src.jsonl"
  with open("data/pasta/train.jsonl", encoding="utf-8") as f:
    head = [next(f) for _ in range(12)]
  src.write_text("".join(head))
  n_ann = sum(json.loads(x)["annotated"] for x in head)
  out = ensure_chat_pd_data(str(tmp_path / "pd.jsonl"), WORDS, src=str(src), seed=0)
  recs = [json.loads(x) for x in open(out)]
  assert len(recs) == n_ann > 0
  for r in recs:
    text = r["messages"][1]["content"]
    ns = [int(p.split("</promise>")[0].rsplit(" ", 1)[1]) for p in text.split("<promise>")[1:]]
    chunks = _chunks(text)
    assert len(ns) == len(chunks) == r["chunks"] > 0
    for n, (body, pads) in zip(ns, chunks):
      assert n == max(1, math.ceil(WORDS(body) / 10))
      assert 0 <= pads <= MAX_PAD and WORDS(body) + pads <= 10 * n
