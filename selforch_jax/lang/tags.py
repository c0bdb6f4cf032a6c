"""The special tokens of the orchestration language (DESIGN.md §3) and their ids.

Tag strings, in the order :func:`add_tags` appends them to a vocabulary::

  <promise>  </promise>  <async>  </async>  <sync/>  <|mask|>  [PAD]  <reg_0> ... <reg_{K-1}>

The seven fixed tags come first so that their ids do not depend on K; registers follow, so that
growing K later appends ``<reg_K>``... without moving anything. For SmolLM2 (49152 tokens) and K = 8
the ids are ``<promise>`` 49152, ``</promise>`` 49153, ``<async>`` 49154, ``</async>`` 49155,
``<sync/>`` 49156, ``<|mask|>`` 49157, ``[PAD]`` 49158, ``<reg_0..7>`` 49159..49166.

A :class:`TagVocab` is the id table every other module of :mod:`selforch_jax.lang` works with; it
also knows which text ids spell the length N of a promise (digits) and which are whitespace, so that
the parser and the serializer need no tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
  "PROMISE_OPEN", "PROMISE_CLOSE", "ASYNC_OPEN", "ASYNC_CLOSE", "SYNC", "MASK", "PAD",
  "FIXED_TAGS", "DEFAULT_NUM_REGISTERS", "TOKENS_PER_UNIT", "MAX_LENGTH_DIGITS",
  "register_tag", "tag_strings", "TagVocab", "add_tags",
]

PROMISE_OPEN = "<promise>"
PROMISE_CLOSE = "</promise>"
ASYNC_OPEN = "<async>"
ASYNC_CLOSE = "</async>"
SYNC = "<sync/>"
MASK = "<|mask|>"
PAD = "[PAD]"
FIXED_TAGS = (PROMISE_OPEN, PROMISE_CLOSE, ASYNC_OPEN, ASYNC_CLOSE, SYNC, MASK, PAD)
DEFAULT_NUM_REGISTERS = 8
TOKENS_PER_UNIT = 10  # a promise of length N announces a chunk of about 10*N tokens (DESIGN.md §3)
MAX_LENGTH_DIGITS = 4  # a promise length with more digits than this counts as missing

_FIELD_OF_TAG = {
  PROMISE_OPEN: "promise_open", PROMISE_CLOSE: "promise_close", ASYNC_OPEN: "async_open",
  ASYNC_CLOSE: "async_close", SYNC: "sync", MASK: "mask", PAD: "pad",
}


def register_tag(k: int) -> str:
  """The text of register tag k, ``"<reg_{k}>"``."""
  return f"<reg_{int(k)}>"


def tag_strings(num_registers: int = DEFAULT_NUM_REGISTERS) -> list[str]:
  """All tag strings in vocabulary order: the 7 fixed tags, then ``<reg_0>..<reg_{K-1}>``.

  Raises:
    ValueError: ``num_registers < 0``.
  """
  if num_registers < 0:
    raise ValueError(f"num_registers must be >= 0, got {num_registers}")
  return list(FIXED_TAGS) + [register_tag(k) for k in range(num_registers)]


@dataclasses.dataclass(frozen=True)
class TagVocab:
  """Ids of the orchestration tags for one vocabulary (DESIGN.md §3), plus the text ids the
  language reads (digits of a promise length, whitespace, end-of-text).

  Attributes:
    promise_open, promise_close, async_open, async_close, sync, mask, pad: tag ids (int).
    registers: ``registers[k]`` is the id of ``<reg_k>``; ``K = len(registers)``.
    eos_ids: ids that end a text (EOS / end of turn). The parser forces a sync there and
      :func:`selforch_jax.lang.mask.build_layout` starts a new packed document after one
      (unless explicit document ids are given).
    digit_ids: ids of the single-character texts ``"0".."9"`` (10 ids, or empty when unknown);
      the serializer spells a promise length N with them.
    number_tokens: further ``(id, digits)`` pairs of tokens whose whole text is a number (e.g.
      Llama-3's ``"123"``), read but never written.
    space_ids: whitespace-only token ids; trailing ones are ignored around a promise length and
      ``space_ids[0]`` separates the topic from the length when serializing.

  Invariant: the tag ids are pairwise distinct and none is a digit, number or space id.

  Raises (construction):
    ValueError: duplicate tag ids, a tag id that is also a digit/space id, or ``digit_ids`` of a
      length other than 0 or 10.
  """

  promise_open: int
  promise_close: int
  async_open: int
  async_close: int
  sync: int
  mask: int
  pad: int
  registers: tuple[int, ...] = ()
  eos_ids: tuple[int, ...] = ()
  digit_ids: tuple[int, ...] = ()
  number_tokens: tuple[tuple[int, str], ...] = ()
  space_ids: tuple[int, ...] = ()
  _tag_of: dict = dataclasses.field(init=False, repr=False, compare=False, hash=False)
  _numbers: dict = dataclasses.field(init=False, repr=False, compare=False, hash=False)

  def __post_init__(self):
    for name in ("registers", "eos_ids", "digit_ids", "space_ids"):
      object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
    object.__setattr__(self, "number_tokens",
                       tuple((int(i), str(s)) for i, s in self.number_tokens))
    tag_of: dict[int, str] = {}
    for tag, field in _FIELD_OF_TAG.items():
      tag_of.setdefault(int(getattr(self, field)), tag)
    for k, i in enumerate(self.registers):
      tag_of.setdefault(i, register_tag(k))
    if len(tag_of) != len(FIXED_TAGS) + len(self.registers):
      raise ValueError(f"tag ids are not distinct: {self}")
    if self.digit_ids and len(self.digit_ids) != 10:
      raise ValueError(f"digit_ids must hold the 10 ids of '0'..'9', got {self.digit_ids}")
    numbers = {i: str(d) for d, i in enumerate(self.digit_ids)}
    for i, s in self.number_tokens:
      if not s.isdigit() or not s.isascii():
        raise ValueError(f"number token {i} has non-digit text {s!r}")
      numbers.setdefault(i, s)
    clash = (set(numbers) | set(self.space_ids)) & set(tag_of)
    if clash:
      raise ValueError(f"ids {sorted(clash)} are both tags and digits/spaces")
    object.__setattr__(self, "_tag_of", tag_of)
    object.__setattr__(self, "_numbers", numbers)

  # ---- constructors -------------------------------------------------------------------------

  @classmethod
  def appended(cls, base_vocab_size: int, num_registers: int = DEFAULT_NUM_REGISTERS, *,
               eos_ids: Iterable[int] = (), digit_ids: Iterable[int] = (),
               number_tokens: Iterable[tuple[int, str]] = (),
               space_ids: Iterable[int] = ()) -> "TagVocab":
    """The ids :func:`add_tags` gives a vocabulary of ``base_vocab_size`` tokens without tags:
    consecutive from ``base_vocab_size`` in :func:`tag_strings` order. For tests and for models
    used without a tokenizer."""
    ids = list(range(base_vocab_size, base_vocab_size + len(FIXED_TAGS) + num_registers))
    return cls(*ids[:len(FIXED_TAGS)], registers=tuple(ids[len(FIXED_TAGS):]),
               eos_ids=tuple(eos_ids), digit_ids=tuple(digit_ids),
               number_tokens=tuple(number_tokens), space_ids=tuple(space_ids))

  @classmethod
  def from_tokenizer(cls, tokenizer: Any, num_registers: int | None = None) -> "TagVocab":
    """Read the tag ids from a tokenizer that already has them (after :func:`add_tags`, or a
    tokenizer restored from an export).

    Args:
      tokenizer: a :class:`selforch_jax.tokenizers.Tokenizer` (needs ``token_to_id``,
        ``encode``, ``eos_id``).
      num_registers: K; ``None`` counts the registers ``<reg_0>, <reg_1>, ...`` present.

    Returns:
      TagVocab with ``eos_ids = (tokenizer.eos_id,)`` (when defined), the ids of ``"0".."9"``
      (when each is one token), number tokens ``"10".."999"`` present in the vocabulary and the
      single-token encodings of ``" "``, ``"\\n"``, ``"\\t"``, ``"  "`` as space ids.

    Raises:
      KeyError: a fixed tag or one of the K registers is not in the vocabulary.
    """
    def need(tag: str) -> int:
      i = tokenizer.token_to_id(tag)
      if i is None:
        raise KeyError(f"tag {tag!r} is not in the tokenizer's vocabulary; call add_tags first")
      return int(i)

    fixed = [need(t) for t in FIXED_TAGS]
    if num_registers is None:
      regs = []
      while tokenizer.token_to_id(register_tag(len(regs))) is not None:
        regs.append(int(tokenizer.token_to_id(register_tag(len(regs)))))
    else:
      regs = [need(register_tag(k)) for k in range(num_registers)]
    tag_ids = set(fixed) | set(regs)

    def single(text: str) -> int | None:
      ids = tokenizer.encode(text)
      return int(ids[0]) if len(ids) == 1 and ids[0] not in tag_ids else None

    digits = [single(str(d)) for d in range(10)]
    digit_ids = tuple(digits) if all(d is not None for d in digits) else ()
    numbers = []
    for n in range(10, 1000):
      i = tokenizer.token_to_id(str(n))
      if i is not None and int(i) not in tag_ids:
        numbers.append((int(i), str(n)))
    spaces = []
    for text in (" ", "\n", "\t", "  "):
      i = single(text)
      if i is not None and i not in spaces and i not in digit_ids:
        spaces.append(i)
    eos = getattr(tokenizer, "eos_id", None)
    eos_ids = (int(eos),) if eos is not None and int(eos) not in tag_ids else ()
    return cls(*fixed, registers=tuple(regs), eos_ids=eos_ids, digit_ids=digit_ids,
               number_tokens=tuple(numbers), space_ids=tuple(spaces))

  def to_dict(self) -> dict[str, Any]:
    """JSON-serialisable dict (for checkpoint / export metadata); inverse of :meth:`from_dict`."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
    return {k: ([list(p) for p in v] if k == "number_tokens" else
                list(v) if isinstance(v, tuple) else v) for k, v in out.items()}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "TagVocab":
    """Inverse of :meth:`to_dict`."""
    d = dict(d)
    d["number_tokens"] = tuple(tuple(p) for p in d.get("number_tokens", ()))
    return cls(**d)

  # ---- queries --------------------------------------------------------------------------------

  @property
  def num_registers(self) -> int:
    """K, the number of register tags."""
    return len(self.registers)

  @property
  def tags(self) -> dict[str, int]:
    """``{tag string: id}`` for every tag, in vocabulary order."""
    return {t: i for i, t in sorted(self._tag_of.items(), key=lambda p: p[0])}

  @property
  def tag_ids(self) -> frozenset[int]:
    """Ids of all tags (fixed and registers)."""
    return frozenset(self._tag_of)

  def is_tag(self, token_id: int) -> bool:
    """Whether ``token_id`` is a tag id."""
    return int(token_id) in self._tag_of

  def tag_of(self, token_id: int) -> str | None:
    """The tag string of ``token_id``, or None for a non-tag id."""
    return self._tag_of.get(int(token_id))

  def id_of(self, tag: str) -> int:
    """The id of a tag string (``"<sync/>"``, ``"<reg_3>"``...).

    Raises:
      KeyError: not a tag of this vocabulary.
    """
    for i, t in self._tag_of.items():
      if t == tag:
        return i
    raise KeyError(f"{tag!r} is not a tag of this TagVocab")

  def register_of(self, token_id: int) -> int | None:
    """k when ``token_id`` is ``<reg_k>``, else None."""
    try:
      return self.registers.index(int(token_id))
    except ValueError:
      return None

  def is_fill(self, token_id: int) -> bool:
    """Whether ``token_id`` is ``<|mask|>`` or ``[PAD]`` (diffusion chunk filler)."""
    return int(token_id) in (self.mask, self.pad)

  def is_number(self, token_id: int) -> bool:
    """Whether ``token_id`` is a digit or number token (reads as part of a promise length)."""
    return int(token_id) in self._numbers

  def is_eos(self, token_id: int) -> bool:
    """Whether ``token_id`` is one of ``eos_ids``."""
    return int(token_id) in self.eos_ids

  # ---- promise lengths --------------------------------------------------------------------------

  def split_length(self, inner: Sequence[int]) -> tuple[tuple[int, ...], int | None]:
    """Split the tokens between ``<promise>`` and ``</promise>`` into (topic ids, length N).

    N is read from the trailing run of digit/number tokens, after dropping trailing space ids;
    the topic is what precedes that run, trailing space ids dropped. N is None (the promise has no
    length) when there is no such run or it has more than ``MAX_LENGTH_DIGITS`` digits.

    Args:
      inner: token ids between the tags.

    Returns:
      ``(topic_ids, N)``; with N None the topic is all of ``inner``.
    """
    ids = [int(i) for i in inner]
    spaces = set(self.space_ids)
    end = len(ids)
    while end and ids[end - 1] in spaces:
      end -= 1
    start = end
    while start and ids[start - 1] in self._numbers:
      start -= 1
    digits = "".join(self._numbers[i] for i in ids[start:end])
    if not digits or len(digits) > MAX_LENGTH_DIGITS:
      return tuple(ids), None
    topic_end = start
    while topic_end and ids[topic_end - 1] in spaces:
      topic_end -= 1
    return tuple(ids[:topic_end]), int(digits)

  def encode_length(self, n: int) -> list[int]:
    """The digit ids spelling the decimal N (no separator).

    Raises:
      ValueError: ``n < 0`` or this vocab has no ``digit_ids``.
    """
    if n < 0:
      raise ValueError(f"promise length must be >= 0, got {n}")
    if not self.digit_ids:
      raise ValueError("this TagVocab has no digit_ids; cannot spell a promise length")
    return [self.digit_ids[int(c)] for c in str(int(n))]


def add_tags(tokenizer: Any, model: Any = None,
             num_registers: int = DEFAULT_NUM_REGISTERS) -> TagVocab:
  """Add the orchestration tags to a tokenizer (and grow a model to match), idempotently.

  DESIGN.md §3: tags are single added special tokens; the model's embedding rows (and untied
  output rows) for them are appended and initialised from the mean of the existing rows.

  **Mutates in place**: the tokenizer gets the tags as special tokens (appended at the end of its
  vocabulary, each encoded as one token; a tag it already has keeps its id), and ``model`` (when
  given) gets ``model.embed`` grown to ``[V', D]``, ``model.lm_head`` (untied) to ``[D, V']`` and
  ``model.cfg = model.cfg.replace(vocab_size=V')`` with ``V' = max(cfg.vocab_size,
  tokenizer.vocab_size)`` (no rounding). Every tag id the tokenizer newly created gets its row set
  to the mean of the rows of the original tokenizer vocabulary (also when a padded vocabulary
  already had a row for it). Calling it again changes nothing; a larger ``num_registers`` appends
  the missing registers. Pass ``model.cfg`` (not a stale cfg) to exports afterwards.

  Args:
    tokenizer: a :class:`selforch_jax.tokenizers.Tokenizer`.
    model: optional :class:`selforch_jax.models.transformer.Transformer`.
    num_registers: K, the number of ``<reg_k>`` tags.

  Returns:
    The :class:`TagVocab` of the tokenizer (:meth:`TagVocab.from_tokenizer`).

  Raises:
    ValueError: the model lacks rows for non-tag ids of the tokenizer (they do not belong
      together), or ``num_registers < 0``.
  """
  names = tag_strings(num_registers)
  old_size = int(tokenizer.vocab_size)
  if model is not None and model.cfg.vocab_size < old_size:
    # only tags (e.g. a tokenizer restored with them) may lack model rows
    present = {tokenizer.token_to_id(n) for n in names} - {None}
    missing = set(range(model.cfg.vocab_size, old_size)) - {int(i) for i in present}
    if missing:
      raise ValueError(
        f"model has {model.cfg.vocab_size} embedding rows but the tokenizer has {old_size} ids, "
        f"{len(missing)} of them not tags; they do not belong together")
  ids = tokenizer.add_special_tokens(names)
  if model is not None:
    from selforch_jax.lang.embeddings import resize_vocab

    new_ids = sorted({int(i) for i in ids if int(i) >= old_size})
    # rows a previous call (or an older checkpoint) did not give the model
    target = max(model.cfg.vocab_size, int(tokenizer.vocab_size))
    grown = [i for i in range(model.cfg.vocab_size, target) if i not in new_ids]
    mean_rows = min(old_size, model.cfg.vocab_size)
    resize_vocab(model, target, init_ids=sorted(set(new_ids) | set(grown)), mean_of=mean_rows)
  return TagVocab.from_tokenizer(tokenizer, num_registers)
