"""A chunk cap never splits a multi-byte character (SmolLM2's byte-level BPE): the assembled text
holds every input character, none turns into U+FFFD."""

import collections
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from selforch_jax.checkpoints import assets
from selforch_jax.lang import assemble, assemble_text
from selforch_jax.lang.parser import MAX_CHAR_OVERRUN, StreamParser, utf8_pending
from selforch_jax.lang.tags import add_tags
from selforch_jax.tokenizers import Tokenizer

TAG_RE = re.compile(r"</?promise>|</?async>|<sync/>")
# ASCII, 2-, 3- and 4-byte characters (𝔘 is three SmolLM2 tokens, é one, 日 two)
ALPHABET = st.sampled_from(list("ab 7.\n") + ["é", "ß", "日", "€", "𝔘", "😀", "𐍈", "ü"])


@pytest.fixture(scope="module")
def tok_tv():
  path = assets.smollm2_gguf_path()  # make installs the GGUF: missing weights fail
  tok = Tokenizer.from_gguf(path)
  return tok, add_tags(tok)


def test_utf8_pending():
  assert utf8_pending(0, "𝔘".encode()[:1]) == 3
  assert utf8_pending(0, "𝔘".encode()[:2]) == 2
  assert utf8_pending(0, "𝔘".encode()) == 0
  assert utf8_pending(2, b"\x94") == 1
  assert utf8_pending(0, "é日".encode()[:3]) == 2   # é done, 日 (3 bytes) started
  assert utf8_pending(2, b"a") == 0                 # broken sequence: a new character starts
  assert utf8_pending(0, b"\x80") == 0              # stray continuation byte


def test_token_bytes_of_smollm2(tok_tv):
  tok, tv = tok_tv
  ids = tok.encode("x𝔘<async>é")
  assert [tok.token_bytes(i) for i in ids] == [b"x", b"\xf0\x9d", b"\x94", b"\x98", b"<async>", b"\xc3\xa9"]
  with pytest.raises(IndexError):
    tok.token_bytes(tok.vocab_size)


def test_issue_example_cap_inside_a_character(tok_tv):
  tok, tv = tok_tv
  ids = tok.encode("<promise>t 1</promise>x<async>𝔘</async>")
  # length_unit=1, cap=1: the budget is 2 tokens, 𝔘 is 3 byte tokens
  split = tok.decode(assemble(ids, tv, cap=1, length_unit=1))  # no token_bytes: the old cut
  assert "\ufffd" in split and "𝔘" not in split
  text = assemble_text(ids, tv, tok, cap=1, length_unit=1)
  assert text == "𝔘x</async>"  # the cap closes after 𝔘's last byte; </async> is then stray text


def test_default_settings_254_tokens_then_an_astral_character(tok_tv):
  tok, tv = tok_tv
  body = " a" * 254 + "𝔘"
  ids = tok.encode(f"<promise>t 1</promise>x<async>{body}</async>")
  assert len(tok.encode(body)) == 257  # the default budget max(20, 256) ends inside 𝔘
  assert "\ufffd" in tok.decode(assemble(ids, tv))
  text = assemble_text(ids, tv, tok)
  assert text == body + "x</async>"


def test_overrun_is_bounded(tok_tv):
  """A token stream that never reaches a character boundary closes MAX_CHAR_OVERRUN tokens late."""
  tok, tv = tok_tv
  lead = tok.encode("𝔘")[0]  # b'\xf0\x9d': always owes continuation bytes
  prefix = tok.encode("<promise>t 1</promise><async>")
  p = StreamParser(tv, cap=1, length_unit=1, token_bytes=tok.token_bytes)
  for t in prefix:
    p.feed(t)
  n = 0
  while p.live_chunks:
    p.feed(lead)
    n += 1
  assert n == 2 + MAX_CHAR_OVERRUN


@st.composite
def annotated(draw):
  text = st.text(ALPHABET, min_size=0, max_size=12)
  n = draw(st.integers(1, 3))
  parts = [draw(text)]
  for _ in range(n):
    parts.append(f"<promise>{draw(text)} {draw(st.integers(1, 3))}</promise>")
  parts.append(draw(text))
  for _ in range(n):
    parts.append(f"<async>{draw(st.text(ALPHABET, min_size=0, max_size=40))}</async>")
  parts.append("<sync/>" + draw(text))
  return "".join(parts), draw(st.integers(1, 8)), draw(st.integers(1, 3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(annotated())
def test_assembled_text_holds_every_input_character(tok_tv, case):
  tok, tv = tok_tv
  source, cap, unit = case
  ids = tok.encode(source)
  text = assemble_text(ids, tv, tok, cap=cap, length_unit=unit, keep_topics=True)
  assert "\ufffd" not in text
  want = collections.Counter(TAG_RE.sub("", source))
  got = collections.Counter(text)
  missing = want - got
  assert not missing, (source, cap, unit, text)
