"""LLM PASTA annotator: a model rewrites a response in the orchestration language, and the rewrite
is accepted only if it keeps the response's words and parses cleanly.

PASTA (Jin et al., ICML 2025, §3) annotated SlimOrca responses with Gemini 1.5 Flash, prompted
with a description of the language and 7 hand-annotated examples; the prompt text is not public.
This module's prompt (:func:`build_messages`) is our own: :data:`LANGUAGE` (the language of
DESIGN.md §3 in our tag syntax) and 3 hand-written examples (:data:`EXAMPLES`: a numbered list, a
bulleted list with an item that refers to the one before it, a response with nothing independent,
returned unchanged).

Backends (one small interface, :class:`ChatBackend` ``.complete(messages) -> str``):

* :class:`OpenAIChatBackend` — any OpenAI-compatible ``POST {base_url}/chat/completions``
  endpoint, through ``urllib`` (no client library); ``base_url``/``model``/``api_key`` from the
  arguments or the environment (``SELFORCH_ANNOTATOR_BASE_URL`` / ``_MODEL`` / ``_API_KEY``,
  falling back to ``OPENAI_BASE_URL`` / ``OPENAI_MODEL`` / ``OPENAI_API_KEY``);
* :class:`EngineChatBackend` — our own engine: the chat template of the given tokenizer, greedy
  (or sampled) decoding with :func:`selforch_jax.runtime.schedulers.ar.generate` on an
  :class:`~selforch_jax.runtime.engine.Engine`.

Validation (never raises; a rejected rewrite is ``Annotation(None, info={"rejected": reason})``):
the output (one surrounding code fence removed) is tokenized with the tag-aware tokenizer; it must
parse with no :class:`~selforch_jax.lang.events.Degraded` event, and its logical text
(:func:`~selforch_jax.lang.assemble.assemble_text`: tags, topics and lengths stripped, chunks at
their promises) must have exactly the response's words in order. Rejection reasons:
``"backend: ..."``, ``"parse: ..."``, ``"words: ..."``, ``"validate: ..."``. A valid reply with
no round (the response given back unchanged) is ``Annotation(None, {"reason": "no round"})``.
"""

from __future__ import annotations

import abc
import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from selforch_jax.lang.annotators.base import Annotation, Annotator, register
from selforch_jax.lang.annotators.report import contains_tag_text, measure_pasta, words_equal
from selforch_jax.lang.assemble import assemble_text
from selforch_jax.lang.tags import TagVocab

__all__ = ["LANGUAGE", "EXAMPLES", "build_messages", "ChatBackend", "OpenAIChatBackend",
           "EngineChatBackend", "PastaLLMAnnotator", "clean_output"]

LANGUAGE = """\
You annotate assistant responses for parallel decoding. Rewrite the RESPONSE in the PASTA \
language so that independent parts can be written at the same time by separate threads.

The language:
- <promise>TOPIC N</promise> announces one independent chunk: TOPIC is at most 5 words naming \
it, N is a whole number, about the chunk's length in tokens divided by 10 (a 45-token chunk has \
N = 5; 1 token is about 3/4 of a word).
- Promises come together in a plan, right after the text that introduces them.
- After the plan, each chunk follows in the same order as <async>chunk text</async>.
- <sync/> comes after the last chunk; the text after it may use all chunks.
- A chunk is written by a thread that sees only the text before the plan and the plan up to its \
own promise, never the other chunks. So make a chunk only of a part that does not refer to its \
siblings ("this", "as above", "the previous step", "step 2"...); keep a part that does in the \
same chunk as the part it refers to.

Rules:
- Do not change, add, drop or reorder any word of the RESPONSE: removing the tags and the \
promises must give the RESPONSE back, word for word. Keep list markers and line breaks inside \
the chunks.
- Make at least 2 chunks per plan, or none: if nothing in the RESPONSE is independent, return it \
unchanged with no tags.
- Return only the rewritten response, nothing else."""

EXAMPLES: tuple[tuple[str, str, str], ...] = (
    ("List three benefits of reading.",
     "Reading has many benefits:\n1. It expands your vocabulary.\n2. It reduces stress by "
     "taking your mind off daily worries.\n3. It improves focus and concentration.\n\nTry to "
     "read a little every day.",
     "Reading has many benefits:\n<promise>Vocabulary 1</promise><promise>Stress 2</promise>"
     "<promise>Focus 1</promise><async>1. It expands your vocabulary.\n</async><async>2. It "
     "reduces stress by taking your mind off daily worries.\n</async><async>3. It improves focus "
     "and concentration.</async><sync/>\n\nTry to read a little every day."),
    ("How do I make a cup of tea and what snacks go with it?",
     "Making tea:\n- Boil fresh water.\n- Then pour it over the tea bag and steep for three "
     "minutes.\n- Biscuits or scones go well with black tea.\n- Fruit pairs nicely with green "
     "tea.",
     "Making tea:\n<promise>Brewing the tea 3</promise><promise>Biscuits or scones 2</promise>"
     "<promise>Fruit 1</promise><async>- Boil fresh water.\n- Then pour it over the tea bag and "
     "steep for three minutes.\n</async><async>- Biscuits or scones go well with black tea.\n"
     "</async><async>- Fruit pairs nicely with green tea.</async><sync/>"),
    ("What is the capital of France?",
     "The capital of France is Paris. It is also the country's largest city.",
     "The capital of France is Paris. It is also the country's largest city."),
)


def _user_turn(prompt: str, response: str) -> str:
  return f"PROMPT:\n{prompt}\n\nRESPONSE:\n{response}"


def build_messages(prompt: str, response: str) -> list[dict[str, str]]:
  """The chat messages of one annotation request: the system turn :data:`LANGUAGE`, the
  :data:`EXAMPLES` as user/assistant pairs, then the user turn with ``prompt`` and ``response``."""
  msgs = [{"role": "system", "content": LANGUAGE}]
  for p, r, a in EXAMPLES:
    msgs += [{"role": "user", "content": _user_turn(p, r)}, {"role": "assistant", "content": a}]
  msgs.append({"role": "user", "content": _user_turn(prompt, response)})
  return msgs


class ChatBackend(abc.ABC):
  """A chat model: messages in, the assistant's reply text out."""

  @abc.abstractmethod
  def complete(self, messages: Sequence[dict[str, str]]) -> str:
    """The reply to ``messages`` (``[{"role", "content"}]``). May raise on transport errors."""


def _env(*names: str) -> str | None:
  for n in names:
    v = os.environ.get(n)
    if v:
      return v
  return None


class OpenAIChatBackend(ChatBackend):
  """Any OpenAI-compatible chat-completions endpoint, through ``urllib``.

  Args:
    base_url: e.g. ``"http://localhost:8000/v1"`` (``/chat/completions`` is appended).
    model: the model name sent in the request.
    api_key: sent as ``Authorization: Bearer ...`` when given.
    temperature, max_tokens: request fields.
    timeout: seconds per request.

  Raises:
    ValueError: no base_url (argument or environment) or no model.
  """

  def __init__(self, base_url: str | None = None, model: str | None = None,
               api_key: str | None = None, temperature: float = 0.0, max_tokens: int = 2048,
               timeout: float = 120.0):
    self.base_url = base_url or _env("SELFORCH_ANNOTATOR_BASE_URL", "OPENAI_BASE_URL")
    self.model = model or _env("SELFORCH_ANNOTATOR_MODEL", "OPENAI_MODEL")
    self.api_key = api_key or _env("SELFORCH_ANNOTATOR_API_KEY", "OPENAI_API_KEY")
    if not self.base_url:
      raise ValueError("OpenAIChatBackend needs base_url (or SELFORCH_ANNOTATOR_BASE_URL / "
                       "OPENAI_BASE_URL in the environment)")
    if not self.model:
      raise ValueError("OpenAIChatBackend needs model (or SELFORCH_ANNOTATOR_MODEL / OPENAI_MODEL)")
    self.temperature = float(temperature)
    self.max_tokens = int(max_tokens)
    self.timeout = float(timeout)

  def complete(self, messages: Sequence[dict[str, str]]) -> str:
    """POST the request; returns ``choices[0].message.content``.

    Raises:
      RuntimeError: HTTP error, unreachable endpoint or a reply without that field.
    """
    body = json.dumps({"model": self.model, "messages": list(messages),
                       "temperature": self.temperature, "max_tokens": self.max_tokens}).encode()
    headers = {"Content-Type": "application/json"}
    if self.api_key:
      headers["Authorization"] = f"Bearer {self.api_key}"
    req = urllib.request.Request(self.base_url.rstrip("/") + "/chat/completions", data=body,
                                 headers=headers, method="POST")
    try:
      with urllib.request.urlopen(req, timeout=self.timeout) as r:
        reply = json.loads(r.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
      raise RuntimeError(f"HTTP {e.code} from {req.full_url}") from None
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
      raise RuntimeError(f"request to {req.full_url} failed: {e}") from None
    try:
      return str(reply["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError):
      raise RuntimeError(f"reply has no choices[0].message.content: {str(reply)[:200]}") from None


class EngineChatBackend(ChatBackend):
  """Our own engine as the annotating model: the tokenizer's chat template, then
  :func:`selforch_jax.runtime.schedulers.ar.generate` (greedy unless ``sampling`` says otherwise).

  Args:
    model: an NNX :class:`~selforch_jax.models.transformer.Transformer`.
    tokenizer: its tokenizer (``encode_chat``, ``decode``, ``stop_ids``).
    max_new_tokens: reply budget in tokens.
    page_size: KV pool page size; the pool is sized for the longest request seen (re-built when
      a longer one comes).
    sampling: :class:`~selforch_jax.runtime.sampling.SamplingParams` (None = greedy).
  """

  def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int = 1024, page_size: int = 64,
               sampling: Any = None):
    self.model = model
    self.tokenizer = tokenizer
    self.max_new_tokens = int(max_new_tokens)
    self.page_size = int(page_size)
    self.sampling = sampling
    self._engine = None
    self._pages = 0

  def _engine_for(self, n_tokens: int):
    from selforch_jax.runtime.engine import Engine
    pages = -(-n_tokens // self.page_size)
    if self._engine is None or pages > self._pages:
      self._pages = 1 << (pages - 1).bit_length()
      self._engine = Engine(self.model, self._pages, self.page_size)
    return self._engine

  def complete(self, messages: Sequence[dict[str, str]]) -> str:
    """Greedy reply (tags written as their strings), stop token excluded."""
    from selforch_jax.runtime.sampling import SamplingParams
    from selforch_jax.runtime.schedulers.ar import generate

    ids = list(self.tokenizer.encode_chat(list(messages), add_generation_prompt=True))
    eng = self._engine_for(len(ids) + self.max_new_tokens)
    res = generate(eng, [ids], max_new_tokens=self.max_new_tokens,
                   sampling=self.sampling or SamplingParams(),
                   stop_ids=tuple(self.tokenizer.stop_ids))
    return self.tokenizer.decode(res[0].token_ids)


def clean_output(text: str) -> str:
  """The model's reply without one surrounding Markdown code fence (```...```), if it has one."""
  t = text.strip("\n")
  if t.startswith("```") and t.rstrip().endswith("```") and t.count("```") == 2:
    t = t.split("\n", 1)[1] if "\n" in t else ""
    t = t.rstrip()[:-3].rstrip("\n")
  return t


@register("pasta_llm")
class PastaLLMAnnotator(Annotator):
  """LLM PASTA annotator (prompt, backends and validation in the module docstring).

  Args:
    tokenizer: a tokenizer with the tags added (validation tokenizes the rewrite with it).
    backend: a :class:`ChatBackend`; None builds an :class:`OpenAIChatBackend` from
      ``base_url``/``model``/``api_key`` or the environment.
    tag_vocab: None = read from the tokenizer.
    base_url, model, api_key: for the default backend.

  Raises:
    ValueError: no tokenizer, a tokenizer without the tags, or (default backend) no endpoint.
  """

  name = "pasta_llm"

  def __init__(self, tokenizer: Any = None, backend: ChatBackend | None = None,
               tag_vocab: TagVocab | None = None, base_url: str | None = None,
               model: str | None = None, api_key: str | None = None):
    if tokenizer is None:
      raise ValueError("pasta_llm needs a tokenizer with the tags to validate rewrites")
    if tag_vocab is None:
      try:
        tag_vocab = TagVocab.from_tokenizer(tokenizer)
      except KeyError as e:
        raise ValueError(f"pasta_llm: {e.args[0]}") from None
    self.tokenizer = tokenizer
    self.tag_vocab = tag_vocab
    self.backend = backend if backend is not None else OpenAIChatBackend(base_url, model, api_key)

  def validate(self, response: str, output: str) -> Annotation:
    """Accept or reject a rewrite ``output`` of ``response`` (see the module docstring)."""
    out = clean_output(output)
    m = measure_pasta(out, self.tokenizer, self.tag_vocab)
    if m["degraded"]:
      return Annotation(None, {"rejected": f"parse: {sorted(set(m['degraded']))}", "output": out})
    plain = assemble_text(self.tokenizer.encode(out), self.tag_vocab, self.tokenizer)
    if not words_equal(plain, response):
      a, b = plain.split(), response.split()
      k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
      got, want = " ".join(a[k:k + 3]), " ".join(b[k:k + 3])
      return Annotation(None, {"rejected": f"words: changed at word {k} ({got!r} vs {want!r})",
                               "output": out})
    if m["chunks"] == 0:  # the model kept the response as it was: nothing independent
      return Annotation(None, {"reason": "no round"})
    return Annotation(out, dict(rounds=m["rounds"], chunks=m["chunks"], lengths=m["lengths"],
                                chunk_tokens=m["chunk_tokens"]))

  def annotate(self, prompt: str, response: str) -> Annotation:
    """Ask the backend for a rewrite and validate it. Never raises."""
    if not isinstance(response, str) or not response.strip():
      return Annotation(None, {"reason": "empty response"})
    if contains_tag_text(response, self.tag_vocab):
      return Annotation(None, {"reason": "response contains tag text"})
    try:
      output = self.backend.complete(build_messages(prompt, response))
    except Exception as e:  # pylint: disable=broad-except  # any backend failure is a rejection
      return Annotation(None, {"rejected": f"backend: {type(e).__name__}: {e}"})
    try:
      return self.validate(response, output)
    except Exception as e:  # pylint: disable=broad-except  # odd text must not stop a data run
      return Annotation(None, {"rejected": f"validate: {type(e).__name__}: {e}"})
