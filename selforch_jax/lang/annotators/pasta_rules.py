r"""Rule-based PASTA annotator: list items and markdown sections -> one PASTA round each.

Structure found (line based; ``\n`` line ends, ``\r`` kept as text):

* **Markdown sections** — when the response has at least two ATX headers (``#`` .. ``######``) at
  its shallowest header level, each header with everything up to the next header of that level is
  one item (the whole response becomes one round; text before the first header is the prefix).
* **Lists** — otherwise every top-level list is a candidate round. An item line is
  ``[indent] marker [space] text`` with marker ``1.``/``1)`` (numbered, up to 3 digits) or one of
  ``- * + • ‣ ◦ – —`` (bulleted). A list is a run of item lines with the same indent and marker
  kind; lines indented deeper (sub-lists, wrapped text) and blank lines between items belong to
  the item above; the list ends at the first non-blank line that is not indented deeper and is not
  an item of the same kind, except in a numbered list whose next number (k+1) follows within 40
  lines with no header or other numbered item at that indent before it (an unindented paragraph
  inside item k).

Independence (an item refers to its siblings -> it cannot be written by a thread that does not
see them). An item other than the first is *dependent* when

* it has no bold/label header and its text (after the marker) starts with a word that points back:
  a demonstrative or pronoun (``this, that, these, those, it, its, they, them, their, such``), a
  sequence word that continues the previous item (``then, next, after that, afterwards,
  afterward, subsequently, again, repeat, continue``), or a comparison with a sibling
  (``similarly, likewise, same, the same, in contrast, unlike, otherwise, both``); or
* anywhere in it: an explicit cross-reference (``as above``, ``as mentioned``/``noted``/
  ``described`` ``above``/``earlier``/``before``/``previously``, ``(mentioned|listed|described)
  above``, ``the previous``/``preceding``/``above``/``last``/``next``/``following`` ``step``/
  ``point``/``item``/``tip``/``section``/``one``, ``step 2``/``point 3``/``item #4``,
  ``the former``, ``the latter``, ``aforementioned``).

A dependent item is merged into the chunk of the item before it (the same thread writes both).
A list (or section set) with fewer than 2 chunks after merging is left as plain text; a response
with no round at all gives ``Annotation(None, info={"reason": ...})``.

Output (DESIGN.md §3, canonical layout; the text between items stays inside the chunks, so the
logical text is the response exactly)::

  prefix <promise>TOPIC_1 N_1</promise>…<promise>TOPIC_n N_n</promise>
         <async>item 1</async>…<async>item n</async><sync/> continuation

* chunk k = item k from the start of its line to the start of item k+1 (marker, sub-lines and
  blank lines included); the last chunk ends at the end of its last non-blank line, the line break
  after it starts the continuation;
* TOPIC = the item's header (a ``#`` header, a leading ``**bold**`` / ``__bold__`` span, or a
  ``Label:`` of at most 5 words), else its first words; at most 5 words of letters/digits
  (``[\w'’&/+-]+``), joined by single spaces ("item k" when none);
* N = ceil(chunk tokens / 10), at least 1; chunk tokens are counted with the tokenizer passed in
  (the chunk text encoded alone, as it sits between tags), or as ceil(1.3 x whitespace words)
  without one.

When the tokenizer has the tags (:func:`~selforch_jax.lang.tags.add_tags`), every annotation is
checked before it is returned: it must parse with no :class:`~selforch_jax.lang.events.Degraded`
event (else ``Annotation(None, info={"rejected": ...})``); ``info`` then holds the real chunk token
counts (:func:`~selforch_jax.lang.annotators.report.measure_pasta`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from selforch_jax.lang.annotators.base import Annotation, Annotator, register
from selforch_jax.lang.annotators.report import contains_tag_text, measure_pasta
from selforch_jax.lang.tags import ASYNC_CLOSE, ASYNC_OPEN, PROMISE_CLOSE, PROMISE_OPEN, SYNC, \
  TOKENS_PER_UNIT, TagVocab

__all__ = ["PastaRulesAnnotator", "find_rounds", "topic_of", "is_dependent", "Item"]

MAX_TOPIC_WORDS = 5
WORDS_TO_TOKENS = 1.3  # tokens per whitespace word when no tokenizer is given

_ITEM = re.compile(r"^([ \t]*)(?:(\d{1,3})[.)]|([-*+•‣◦–—]))[ \t]+(?=\S)")
_HEADER = re.compile(r"^[ \t]{0,3}(#{1,6})[ \t]+(\S.*?)[ \t#]*$")
_BACK_START = re.compile(
  r"^(?:this|that|these|those|it|its|it's|they|them|their|such|then|next|after that|afterwards?|"
  r"subsequently|again|repeat|continue|similarly|likewise|same|the same|in contrast|unlike|"
  r"otherwise|both)\b", re.IGNORECASE)
_BACK_ANY = re.compile(
  r"\b(?:as above|as (?:mentioned|noted|stated|described|discussed|shown) "
  r"(?:above|earlier|before|previously)|(?:mentioned|listed|described|noted) above|"
  r"the (?:previous|preceding|above|last|next|following) (?:steps?|points?|items?|tips?|"
  r"sections?|ones?)|(?:step|point|item|tip|section) #?\d+|the former|the latter|aforementioned)\b",
  re.IGNORECASE)
_BOLD = re.compile(r"^(\*\*|__)(.+?)\1")
_LABEL = re.compile(r"^([^:\n]{1,60}?)(?::(?:\s|$)|[ \t]+[-–—][ \t]+)")
_WORD = re.compile(r"[\w'’&/+-]+")


@dataclasses.dataclass
class Item:
  """One list item or section: ``text[start:end]`` of the response, its topic and whether it
  refers back to a sibling."""

  start: int
  end: int
  topic: str
  dependent: bool


def _lines(text: str) -> list[tuple[int, str]]:
  """(offset, line without its ``\\n``) for every line of ``text``."""
  out, pos = [], 0
  for line in text.split("\n"):
    out.append((pos, line))
    pos += len(line) + 1
  return out


def topic_of(body: str, k: int) -> str:
  """The topic of an item whose text (marker removed) is ``body``: its header (``**bold**``,
  ``__bold__`` or a ``Label:`` / ``Label - `` of at most 5 words), else its first words; at most
  :data:`MAX_TOPIC_WORDS` words, ``"item {k+1}"`` when it has none."""
  head = body.strip().lstrip("#").strip()
  m = _BOLD.match(head)
  if m:
    head = m.group(2)
  else:
    m = _LABEL.match(head)
    if m and len(m.group(1).split()) <= MAX_TOPIC_WORDS:
      head = m.group(1)
  words = _WORD.findall(head.replace("**", " ").replace("__", " "))
  words = [w.strip("-'’") or w for w in words][:MAX_TOPIC_WORDS]
  words = [w for w in words if w]
  return " ".join(words) if words else f"item {k + 1}"


def _strip_head(body: str) -> str:
  """The item's text after a bold span or label, for the back-reference test."""
  b = body.strip()
  m = _BOLD.match(b)
  if m:
    b = b[m.end():]
  else:
    m = _LABEL.match(b)
    if m and len(m.group(1).split()) <= MAX_TOPIC_WORDS:
      b = b[m.end():]
  return b.lstrip(" \t:-–—*_").strip()


def is_dependent(item_text: str, body: str) -> bool:
  """Whether an item (full text ``item_text``; first-line text without marker ``body``) refers to
  its siblings (rules in the module docstring). After a header (``**X**``, ``X:``) a leading
  "This"/"It" refers to that header, so the start-word rule applies only to items without one."""
  rest = _strip_head(body)
  headed = rest != body.strip().lstrip(" \t:-–—*_").strip()
  return bool((not headed and _BACK_START.match(rest)) or _BACK_ANY.search(item_text))


def _finish(text: str, items: list[Item]) -> list[Item]:
  """Merge dependent items into the previous chunk; the last chunk ends at its last non-blank
  character line end."""
  merged: list[Item] = []
  for it in items:
    if it.dependent and merged:
      merged[-1].end = it.end
    else:
      merged.append(dataclasses.replace(it, dependent=False))
  if merged:
    last = merged[-1]
    seg = text[last.start:last.end]
    last.end = last.start + len(seg.rstrip("\n\t "))
  return merged


def _sections(text: str) -> list[list[Item]]:
  lines = _lines(text)
  heads = []
  for off, line in lines:
    m = _HEADER.match(line)
    if m:
      heads.append((off, len(m.group(1)), m.group(2)))
  if not heads:
    return []
  level = min(h[1] for h in heads)
  top = [h for h in heads if h[1] == level]
  if len(top) < 2:
    return []
  items = []
  for k, (off, _, title) in enumerate(top):
    end = top[k + 1][0] if k + 1 < len(top) else len(text)
    body_text = text[off:end]
    first_para = body_text.split("\n", 1)[1] if "\n" in body_text else ""
    items.append(Item(off, end, topic_of(title, k),
                      k > 0 and is_dependent(body_text, first_para.strip())))
  return [_finish(text, items)]


def self_next(lines: list[tuple[int, str]], j: int, indent: int, number: int,
              lookahead: int = 40) -> int | None:
  """Index of the line ``number.``/``number)`` at ``indent`` among the next ``lookahead`` lines
  from ``j``, when no header or other numbered item at that indent comes first; else None."""
  for k in range(j, min(len(lines), j + lookahead)):
    line = lines[k][1]
    if _HEADER.match(line):
      return None
    m = _ITEM.match(line)
    if m and len(m.group(1).expandtabs(4)) == indent and m.group(2) is not None:
      return k if int(m.group(2)) == number else None
  return None


def _lists(text: str) -> list[list[Item]]:
  lines = _lines(text)
  rounds: list[list[Item]] = []
  i = 0
  while i < len(lines):
    m = _ITEM.match(lines[i][1])
    if not m:
      i += 1
      continue
    indent, numbered = len(m.group(1).expandtabs(4)), m.group(2) is not None
    kind = "num" if numbered else m.group(3)
    starts = [(i, lines[i][1][m.end():])]
    j = i + 1
    last_item_line = i
    while j < len(lines):
      line = lines[j][1]
      if not line.strip():
        j += 1
        continue
      mj = _ITEM.match(line)
      ind = len(line) - len(line.lstrip(" \t"))
      ind = len(line[:ind].expandtabs(4))
      if mj and len(mj.group(1).expandtabs(4)) == indent and \
          ("num" if mj.group(2) is not None else mj.group(3)) == kind:
        starts.append((j, line[mj.end():]))
        last_item_line = j
      elif ind > indent:
        last_item_line = j
      elif numbered and self_next(lines, j, indent, int(m.group(2)) + len(starts)) is not None:
        last_item_line = j  # lazy paragraph inside a numbered item: the numbering goes on below
      else:
        break
      j += 1
    # the list covers lines i .. last_item_line
    list_end = lines[last_item_line][0] + len(lines[last_item_line][1])
    items = []
    for k, (li, body) in enumerate(starts):
      start = lines[li][0]
      end = lines[starts[k + 1][0]][0] if k + 1 < len(starts) else list_end
      items.append(Item(start, end, topic_of(body, k),
                        k > 0 and is_dependent(text[start:end], body)))
    rounds.append(_finish(text, items))
    i = last_item_line + 1
  return rounds


def find_rounds(text: str) -> list[list[Item]]:
  """The candidate rounds of a response: sections if it has them (one round), else its top-level
  lists (one round each), dependent items already merged; rounds with fewer than 2 chunks are
  dropped. Items are character spans of ``text`` in order, non-overlapping."""
  rounds = _sections(text) or _lists(text)
  return [r for r in rounds if len(r) >= 2]


@register("pasta_rules")
class PastaRulesAnnotator(Annotator):
  """Rule-based PASTA annotator (rules and output format in the module docstring).

  Args:
    tokenizer: counts chunk tokens for N (``encode(str) -> list[int]``); None = estimate
      ``ceil(1.3 x words)``. When it has the tags, each annotation is parsed and checked.
    tag_vocab: the tags (None = read from the tokenizer when it has them).
    unit: tokens per unit of N (DESIGN.md §3: 10).
  """

  name = "pasta_rules"

  def __init__(self, tokenizer: Any = None, tag_vocab: TagVocab | None = None,
               unit: int = TOKENS_PER_UNIT):
    self.tokenizer = tokenizer
    self.unit = int(unit)
    if tag_vocab is None and tokenizer is not None:
      try:
        tag_vocab = TagVocab.from_tokenizer(tokenizer)
      except KeyError:
        tag_vocab = None
    self.tag_vocab = tag_vocab

  def count_tokens(self, text: str) -> int:
    """Tokens of ``text`` as it sits between two tags (tokenizer), or ceil(1.3 x words)."""
    if self.tokenizer is not None:
      return len(self.tokenizer.encode(text))
    return math.ceil(WORDS_TO_TOKENS * len(text.split()))

  def annotate(self, prompt: str, response: str) -> Annotation:
    """Annotate ``response`` (see the module docstring). Never raises on text."""
    if not isinstance(response, str) or not response.strip():
      return Annotation(None, {"reason": "empty response"})
    if contains_tag_text(response, self.tag_vocab):
      return Annotation(None, {"reason": "response contains tag text"})
    rounds = find_rounds(response)
    if not rounds:
      return Annotation(None, {"reason": "fewer than 2 independent items"})
    parts: list[str] = []
    lengths, toks = [], []
    cursor = 0
    for items in rounds:
      parts.append(response[cursor:items[0].start])
      chunks = [response[it.start:it.end] for it in items]
      counts = [self.count_tokens(c) for c in chunks]
      ns = [max(1, math.ceil(c / self.unit)) for c in counts]
      parts.extend(f"{PROMISE_OPEN}{it.topic} {n}{PROMISE_CLOSE}" for it, n in zip(items, ns))
      parts.extend(f"{ASYNC_OPEN}{c}{ASYNC_CLOSE}" for c in chunks)
      parts.append(SYNC)
      lengths += ns
      toks += counts
      cursor = items[-1].end
    parts.append(response[cursor:])
    text = "".join(parts)
    info: dict[str, Any] = dict(rounds=len(rounds), chunks=len(lengths), lengths=lengths,
                                chunk_tokens=toks, estimated=self.tokenizer is None)
    if self.tag_vocab is not None and self.tokenizer is not None:
      m = measure_pasta(text, self.tokenizer, self.tag_vocab)
      if m["degraded"] or m["chunks"] != len(lengths) or m["lengths"] != lengths:
        return Annotation(None, {"rejected": f"parse: degraded {m['degraded']}, "
                                             f"{m['chunks']} chunks for {len(lengths)}"})
      info["chunk_tokens"] = m["chunk_tokens"]
    return Annotation(text, info)
