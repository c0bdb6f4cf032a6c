r"""TIP register annotation with a language model's dependence graph (DESIGN.md §6).

The response is split into steps as for GSM8K (lines; :func:`~.tip_gsm8k.split_steps`); a prompt
(:func:`dependence_prompt`) numbers the steps from 1 and asks the model for the graph as JSON,
``{"2": [1], "3": [1, 2], ...}`` (step -> earlier steps it uses). :func:`parse_graph` reads the
reply robustly (code fences and prose around the JSON, string or int keys and ids, a list of
lists instead of an object, missing steps = no uses); a reply that names a later or unknown step,
or has no JSON at all, is rejected: ``Annotation(None, info={"rejected": reason, "reply": ...})``.
The last step (the final answer) is kept alive; registers then come from
:func:`selforch_jax.lang.registers.linear_scan` like the rule-based annotator.

Backends (a callable ``prompt -> reply text``):

* :class:`OpenAIChatBackend`: any OpenAI-compatible ``/v1/chat/completions`` endpoint, standard
  library ``urllib`` only (greedy, temperature 0);
* :class:`EngineBackend`: this project's engine, :func:`selforch_jax.runtime.schedulers.ar.generate` with the
  model's chat template (greedy).

A backend error (connection refused, HTTP error, timeout, bad JSON envelope) is also a rejection:
``annotate`` never raises.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from typing import Any, Callable

from selforch_jax.lang.annotators.base import Annotation, Annotator, register
from selforch_jax.lang.annotators.tip_gsm8k import annotate_with_graph, split_steps
from selforch_jax.lang.tags import DEFAULT_NUM_REGISTERS

__all__ = ["TipLLMAnnotator", "dependence_prompt", "parse_graph", "GraphParseError",
           "OpenAIChatBackend", "EngineBackend"]


class GraphParseError(ValueError):
  """A model's reply does not hold a valid dependence graph."""


def dependence_prompt(question: str, steps: list[str]) -> str:
  """The instruction that asks a model for the dependence graph of numbered ``steps``."""
  body = "\n".join(f"Step {i + 1}: {s.strip()}" for i, s in enumerate(steps))
  return (
    "Below is a problem and its step-by-step solution. For every step, list the earlier steps "
    "whose results it uses (not the problem statement). Answer with JSON only: an object that "
    "maps each step number to the list of earlier step numbers it uses, e.g. "
    '{"1": [], "2": [1], "3": [1, 2]}.\n\n'
    f"Problem: {question.strip()}\n\nSolution:\n{body}\n")


def _json_candidates(reply: str) -> list[str]:
  fenced = re.findall(r"```(?:json)?\s*(.*?)```", reply, re.S)
  out = [f.strip() for f in fenced]
  for opener, closer in (("{", "}"), ("[", "]")):
    i, j = reply.find(opener), reply.rfind(closer)
    if 0 <= i < j:
      out.append(reply[i:j + 1])
  return out


def _as_int(x: Any, what: str) -> int:
  if isinstance(x, bool):
    raise GraphParseError(f"{what} {x!r} is not a step number")
  if isinstance(x, int):
    return x
  if isinstance(x, float) and x.is_integer():
    return int(x)
  if isinstance(x, str):
    m = re.fullmatch(r"\s*(?:step\s*)?(\d+)\s*", x, re.I)
    if m:
      return int(m.group(1))
  raise GraphParseError(f"{what} {x!r} is not a step number")


def parse_graph(reply: str, num_steps: int) -> list[set[int]]:
  """Read a dependence graph (1-based step numbers) from a model reply.

  Args:
    reply: the model's text.
    num_steps: n, the number of steps in the prompt.

  Returns:
    ``uses`` with 0-based indices: ``uses[j]`` = earlier steps step j uses (steps the reply does
    not mention use nothing).

  Raises:
    GraphParseError: no JSON object/array in the reply, a step number outside ``1..n``, or a step
      that uses itself or a later step.
  """
  data, err = None, "no JSON object or array in the reply"
  for cand in _json_candidates(reply or ""):
    try:
      data = json.loads(cand)
      break
    except json.JSONDecodeError as e:
      err = f"invalid JSON: {e}"
  if data is None:
    raise GraphParseError(err)
  if isinstance(data, list):
    data = {i + 1: v for i, v in enumerate(data)}
  if not isinstance(data, dict):
    raise GraphParseError(f"expected an object step -> list, got {type(data).__name__}")
  uses: list[set[int]] = [set() for _ in range(num_steps)]
  for k, v in data.items():
    j = _as_int(k, "step")
    if not 1 <= j <= num_steps:
      raise GraphParseError(f"step {j} is not one of 1..{num_steps}")
    if v is None:
      continue
    for x in (v if isinstance(v, list) else [v]):
      i = _as_int(x, f"use of step {j}")
      if not 1 <= i < j:
        raise GraphParseError(f"step {j} uses step {i}, which is not an earlier step")
      uses[j - 1].add(i - 1)
  return uses


class OpenAIChatBackend:
  """``prompt -> reply`` through an OpenAI-compatible chat-completions endpoint (urllib).

  Args:
    base_url: e.g. ``"http://localhost:8000/v1"`` (``/chat/completions`` is appended).
    model: the model name sent in the request.
    api_key_env: name of the environment variable holding the API key (none sent if unset).
    timeout: seconds per request.
    max_tokens: reply budget.

  Raises (on call):
    OSError / urllib.error.URLError: connection or HTTP failure; ValueError: a response without
    ``choices[0].message.content``.
  """

  def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY",
               timeout: float = 60.0, max_tokens: int = 512):
    self.url = base_url.rstrip("/") + "/chat/completions"
    self.model, self.api_key_env = model, api_key_env
    self.timeout, self.max_tokens = float(timeout), int(max_tokens)

  def __call__(self, prompt: str) -> str:
    body = json.dumps({"model": self.model, "temperature": 0, "max_tokens": self.max_tokens,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(self.api_key_env) if self.api_key_env else None
    if key:
      headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=self.timeout) as r:
      out = json.loads(r.read().decode())
    try:
      return str(out["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError) as e:
      raise ValueError(f"endpoint reply has no choices[0].message.content: {str(out)[:200]}") from e


class EngineBackend:
  """``prompt -> reply`` with this project's engine (greedy AR through the paged KV pool).

  Args:
    model: an NNX :class:`~selforch_jax.models.transformer.Transformer`.
    tokenizer: its tokenizer (chat template, ``stop_ids``).
    max_new_tokens: reply budget.
    page_size: KV page size; the pool holds one prompt plus the reply.
  """

  def __init__(self, model, tokenizer, max_new_tokens: int = 256, page_size: int = 16):
    from selforch_jax.runtime.engine import Engine
    self.model, self.tokenizer = model, tokenizer
    self.max_new_tokens, self.page_size = int(max_new_tokens), int(page_size)
    self._engine_cls = Engine
    self._engine = None
    self._slots = 0

  def __call__(self, prompt: str) -> str:
    from selforch_jax.runtime.schedulers.ar import generate
    ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=True)
    need = len(ids) + self.max_new_tokens
    if self._engine is None or need > self._slots:
      pages = -(-need // self.page_size) + 1
      self._engine = self._engine_cls(self.model, pages, self.page_size)
      self._slots = pages * self.page_size
    res = generate(self._engine, [ids], max_new_tokens=self.max_new_tokens,
                   stop_ids=tuple(self.tokenizer.stop_ids))
    return self.tokenizer.decode(res[0].token_ids, skip_special_tokens=True)


@register("tip_llm")
class TipLLMAnnotator(Annotator):
  """Response -> register-tagged response, with the dependence graph from a model.

  Args:
    backend: a callable ``prompt -> reply`` (:class:`OpenAIChatBackend`, :class:`EngineBackend`
      or any function); or None with ``base_url`` and ``model`` given (an OpenAI-compatible
      endpoint).
    num_registers: K >= 1.
    spill: ``"merge"`` or ``"reject"`` (see :mod:`selforch_jax.lang.registers`).
    base_url, model, api_key_env: build an :class:`OpenAIChatBackend` when ``backend`` is None.

  ``annotate`` never raises: backend failures and unusable replies give
  ``Annotation(None, info={"rejected": reason, ...})``; success gives the same ``info`` as the
  GSM8K annotator plus ``reply``.

  Raises:
    ValueError: no backend and no ``base_url``/``model``; K < 1 (construction only).
  """

  name = "tip_llm"

  def __init__(self, backend: Callable[[str], str] | None = None,
               num_registers: int = DEFAULT_NUM_REGISTERS, spill: str = "merge", *,
               base_url: str | None = None, model: str | None = None,
               api_key_env: str = "OPENAI_API_KEY"):
    if backend is None:
      if not base_url or not model:
        raise ValueError("tip_llm needs a backend callable, or base_url and model of an "
                         "OpenAI-compatible endpoint")
      backend = OpenAIChatBackend(base_url, model, api_key_env)
    if num_registers < 1:
      raise ValueError(f"num_registers must be >= 1, got {num_registers}")
    self.backend, self.num_registers, self.spill = backend, int(num_registers), spill

  def annotate(self, prompt: str, response: str) -> Annotation:
    steps = split_steps(response or "")
    if not steps:
      return Annotation(None, info={"rejected": "empty response"})
    try:
      reply = self.backend(dependence_prompt(prompt or "", steps))
    except Exception as e:  # noqa: BLE001 - any backend failure is a rejection, never a crash
      return Annotation(None, info={"rejected": f"backend error: {type(e).__name__}: {e}"})
    try:
      uses = parse_graph(reply, len(steps))
    except GraphParseError as e:
      return Annotation(None, info={"rejected": str(e), "reply": reply})
    out = annotate_with_graph(steps, uses, len(steps) - 1, self.num_registers, self.spill)
    return Annotation(out.text, info={**out.info, "reply": reply})
