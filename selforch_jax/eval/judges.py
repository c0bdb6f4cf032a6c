"""Pairwise judges (AlpacaEval-style win rate; DESIGN.md §7, issue 5 "Quality").

One interface, :class:`PairwiseJudge`: ``prefer(instruction, output_a, output_b)`` returns the
probability-like score in ``[0, 1]`` that ``output_a`` is the better answer. Two backends:

* :class:`OpenAIJudge` — any OpenAI-compatible ``/chat/completions`` endpoint through the
  ``openai`` client (its timeouts and retries with backoff on connection errors, 408/409/429 and
  5xx). The judge prompt (:data:`JUDGE_PROMPT`) follows AlpacaEval's ranking prompt
  (Li et al. 2023, alpaca_eval ``alpaca_eval_gpt4``: two outputs, answer with ``m`` or ``M``):
  reply ``"m"`` prefers output (m) = a, ``"M"`` prefers output (M) = b; anything else counts as
  0.5 (a tie) and is recorded as unparsed.
* :class:`LocalJudge` — the same prompt scored by a local model through our engine: the score is
  ``softmax`` over the next-token logits of the two answer tokens ``"m"`` and ``"M"`` after the
  prompt (one prefill step; no text generation).

:func:`win_rate` evaluates both orders of every pair (position-bias control, as AlpacaEval's
``is_randomize_output_order``) and returns per-example scores plus a bootstrap 95% CI.
"""

from __future__ import annotations

import abc
import os
from typing import Any, Sequence

import numpy as np

from selforch_jax.eval.stats import bootstrap_ci

__all__ = ["JUDGE_PROMPT", "PairwiseJudge", "OpenAIJudge", "LocalJudge", "pair_score",
           "win_rate", "make_judge", "config_error"]

JUDGE_PROMPT = (
    "I want you to create a leaderboard of different large-language models. To do so, I will "
    "give you the instructions (prompts) given to the models, and the responses of two models. "
    "Please rank the models based on which responses would be preferred by humans.\n\n"
    "## Instruction\n\n{instruction}\n\n"
    "## Model Outputs\n\n"
    "### Output (m)\n\n{output_1}\n\n"
    "### Output (M)\n\n{output_2}\n\n"
    "## Task\n\nEvaluate the models based on the quality and relevance of their outputs, and "
    "select the model that generated the best output. Answer by providing the model identifier "
    "of the best model. Output only one of: m or M.")


class PairwiseJudge(abc.ABC):
  """A pairwise judge. Subclasses implement :meth:`prefer`."""

  unparsed: int = 0  # replies that named neither output (scored 0.5)

  @abc.abstractmethod
  def prefer(self, instruction: str, output_a: str, output_b: str) -> float:
    """Score in ``[0, 1]`` that ``output_a`` is better than ``output_b`` (0.5: tie/unknown)."""


class OpenAIJudge(PairwiseJudge):
  """Judge through an OpenAI-compatible chat-completions endpoint.

  Args:
    url: base URL, e.g. ``"https://api.openai.com/v1"`` or ``"http://localhost:8000/v1"``
      (``/chat/completions`` is appended).
    model: the judge model name sent in the request.
    api_key: bearer token (``None``: read ``api_key_env``; empty: the placeholder ``"EMPTY"``,
      which local servers such as vLLM accept -- the client always sends a key).
    api_key_env: environment variable holding the key.
    timeout_s: timeout of one HTTP attempt in seconds.
    max_retries: further attempts after a connection error, timeout, 408/409/429 or 5xx
      (the client's exponential backoff between them).

  Raises (in :meth:`prefer`):
    openai.APIConnectionError / APITimeoutError: the endpoint is unreachable or too slow (after
      the retries); openai.APIStatusError: it refused the request (4xx other than the above).
    ValueError: the reply is not a chat completion.
  """

  def __init__(self, url: str, model: str, api_key: str | None = None,
               api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 60.0, max_retries: int = 2):
    import openai  # noqa: PLC0415 - only this backend needs it

    if not url:
      raise ValueError("OpenAIJudge needs a base url")
    self.url = url.rstrip("/") + "/chat/completions"
    self.model = model
    self.api_key = os.environ.get(api_key_env, "") if api_key is None else api_key
    self.timeout_s = timeout_s
    self.max_retries = int(max_retries)
    self.client = openai.OpenAI(base_url=url.rstrip("/"), api_key=self.api_key or "EMPTY",
                                timeout=timeout_s, max_retries=self.max_retries)
    self.unparsed = 0

  def prefer(self, instruction: str, output_a: str, output_b: str) -> float:
    reply = self.client.chat.completions.create(
        model=self.model, temperature=0, max_tokens=2,
        messages=[{"role": "user", "content": JUDGE_PROMPT.format(
            instruction=instruction, output_1=output_a, output_2=output_b)}])
    try:
      text = reply.choices[0].message.content.strip()
    except (AttributeError, IndexError, TypeError) as e:
      raise ValueError(f"judge reply is not a chat completion: {str(reply)[:200]}") from e
    if text.startswith("m"):
      return 1.0
    if text.startswith("M"):
      return 0.0
    self.unparsed += 1
    return 0.5


class LocalJudge(PairwiseJudge):
  """Judge with a local model through the engine: ``P(m) / (P(m) + P(M))`` of the next token
  after :data:`JUDGE_PROMPT` in the model's chat template.

  Args:
    engine: an :class:`~selforch_jax.runtime.engine.Engine` of the judge model.
    tokenizer: its tokenizer (chat template; ``"m"`` and ``"M"`` must each be one token).
    max_prompt_tokens: outputs are truncated (by characters, equally) so that the prompt fits.

  Raises:
    ValueError: ``"m"`` or ``"M"`` is not a single token.
  """

  MAX_PROMPT_TOKENS = 1536

  def __init__(self, engine: Any, tokenizer: Any, max_prompt_tokens: int = MAX_PROMPT_TOKENS):
    ids_m, ids_M = tokenizer.encode("m"), tokenizer.encode("M")
    if len(ids_m) != 1 or len(ids_M) != 1:
      raise ValueError("LocalJudge needs 'm' and 'M' to be single tokens")
    self.engine, self.tok = engine, tokenizer
    self.ids = (ids_m[0], ids_M[0])
    self.max_prompt_tokens = int(max_prompt_tokens)
    self.unparsed = 0

  def _prompt(self, instruction: str, a: str, b: str) -> list[int]:
    limit = None
    while True:
      aa, bb = (a, b) if limit is None else (a[:limit], b[:limit])
      msg = JUDGE_PROMPT.format(instruction=instruction, output_1=aa, output_2=bb)
      ids = self.tok.encode_chat([{"role": "user", "content": msg}], add_generation_prompt=True)
      if len(ids) <= self.max_prompt_tokens or (limit is not None and limit < 16):
        return ids
      limit = max(len(a), len(b)) // 2 if limit is None else limit // 2

  def prefer(self, instruction: str, output_a: str, output_b: str) -> float:
    from selforch_jax.runtime.registry import fresh_bases

    ids = self._prompt(instruction, output_a, output_b)
    owner, seg = fresh_bases(self.engine)
    vis = np.zeros((seg + 1, seg + 1), bool)
    vis[seg, seg] = True
    logits, _ = self.engine.run_step(ids, np.arange(len(ids)), np.full(len(ids), seg), owner,
                                     vis, np.zeros(seg + 1, bool))
    self.engine.pool.free_owner(owner)
    last = np.asarray(logits[-1], np.float64)
    lm, lM = last[self.ids[0]], last[self.ids[1]]
    return float(1.0 / (1.0 + np.exp(lM - lm)))


def pair_score(judge: PairwiseJudge, instruction: str, output: str, reference: str) -> float:
  """Score in ``[0, 1]`` of ``output`` against ``reference``: ``(prefer(x, out, ref) + 1 -
  prefer(x, ref, out)) / 2``, both orders averaged (position-bias control)."""
  return (judge.prefer(instruction, output, reference) + 1.0
          - judge.prefer(instruction, reference, output)) / 2.0


def win_rate(judge: PairwiseJudge, instructions: Sequence[str], outputs: Sequence[str],
             references: Sequence[str], n_boot: int = 10000, seed: int = 0) -> dict:
  """Win rate of ``outputs`` over ``references``, both orders averaged per example.

  Returns:
    ``dict(per_example=[...], ci=bootstrap_ci(...), unparsed=...)``; ``per_example[i]`` =
    ``(prefer(x, out, ref) + 1 - prefer(x, ref, out)) / 2``.

  Raises:
    ValueError: the three lists differ in length or are empty.
  """
  if not (len(instructions) == len(outputs) == len(references)) or not instructions:
    raise ValueError("win_rate needs equally long, non-empty instruction/output/reference lists")
  scores = [pair_score(judge, x, out, ref) for x, out, ref in zip(instructions, outputs, references)]
  return {"per_example": scores, "ci": bootstrap_ci(scores, n_boot=n_boot, seed=seed),
          "unparsed": judge.unparsed}


BACKENDS = ("", "none", "openai", "local")


def config_error(jc: Any, key: str = "judge") -> str | None:
  """What is wrong with a judge config section ``jc`` (named ``key`` in the message), or None."""
  if jc.backend not in BACKENDS:
    return f"{key}.backend={jc.backend!r}; known: '' or 'none' (no judge), 'openai', 'local'"
  if jc.backend == "openai" and not (jc.url and jc.get("model")):
    return f"{key}.backend='openai' needs {key}.url and {key}.model (url={jc.url!r}, " \
           f"model={jc.get('model')!r})"
  return None


def make_judge(jc: Any, engine: Any = None, tokenizer: Any = None) -> PairwiseJudge | None:
  """A judge from a config section ``jc`` (``backend``: ``""``/``"none"``, ``"openai"``,
  ``"local"``; ``url``, ``model``, ``api_key_env``); ``None`` when no judge is configured.
  ``"local"`` uses ``engine``/``tokenizer`` (the baseline model unless the caller passes
  another).

  Raises:
    ValueError: what :func:`config_error` finds (unknown backend, ``"openai"`` without ``url``
      or ``model``).
  """
  bad = config_error(jc)
  if bad:
    raise ValueError(bad)
  if jc.backend in ("", "none"):
    return None
  if jc.backend == "openai":
    return OpenAIJudge(jc.url, jc.model, api_key_env=jc.get("api_key_env", "OPENAI_API_KEY"))
  return LocalJudge(engine, tokenizer)
