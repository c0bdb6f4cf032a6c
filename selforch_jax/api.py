"""The public Python API: :func:`generate` — decode prompts with any runtime, get text + figures.

::

  import selforch_jax
  out = selforch_jax.generate(["Name three colors."], runtime="ar", max_new_tokens=64)
  print(out[0].text, out[0].finish_reason, out[0].tokens_per_forward)

Every runtime registered in :mod:`selforch_jax.runtime.schedulers` is reachable by name
(:data:`RUNTIMES`): ``ar``, ``pasta``, ``tip``, ``sot``, ``apar``, ``streaming_llm``, ``h2o``.
The decode CLI (``python -m selforch_jax.decode``) and the Colab notebook use this module;
:func:`decode_ids` is the one place where scheduler results become answers (text, stop strings,
finish reason, figures) for every runtime.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Sequence

__all__ = ["Answer", "RUNTIMES", "TAGGED_RUNTIMES", "DEFAULT_ADAPTERS", "generate",
           "decode_ids", "load", "check_adapter", "ApiError"]

RUNTIMES = ("ar", "pasta", "tip", "sot", "apar", "streaming_llm", "h2o", "ptd", "pld", "lookahead",
            "orthrus", "planned_diffusion", "sol")
SPECULATIVE_RUNTIMES = ("ptd", "pld", "lookahead", "orthrus")  # lossless draft + verify
TAGGED_RUNTIMES = ("pasta", "tip", "planned_diffusion")   # need a model with the tags
DEFAULT_ADAPTERS = {("pasta", "smollm2_135m"): "adapters/pasta_smollm2_135m"}
DEFAULT_KV_BUDGET = 256                     # streaming_llm / h2o live tokens per request
# max_new_tokens when a caller gives none: a PASTA plan alone can take 128 tokens, a TIP answer
# carries its register tags
DEFAULT_MAX_NEW_TOKENS = {"pasta": 512, "tip": 512, "planned_diffusion": 512}
# decode_ids options a planned_diffusion job passes on (PlannedDiffusionScheduler's arguments)
PD_OPTIONS = ("steps_ratio", "eps", "confidence", "threshold", "max_promises", "max_rounds",
              "plan_cap", "default_length", "max_length", "full_attention", "full_diffusion",
              "pad_last", "spread", "window", "pad_tail", "seed_topic")
DEFAULT_MAX_NEW_TOKENS_OTHER = 128


def default_max_new_tokens(runtime: str, max_new_tokens: int | None = None) -> int:
  """``max_new_tokens`` if given (> 0), else the runtime's default: 512 for pasta / tip (tags
  included), 128 for the others."""
  if max_new_tokens:
    return int(max_new_tokens)
  return DEFAULT_MAX_NEW_TOKENS.get(runtime, DEFAULT_MAX_NEW_TOKENS_OTHER)


class ApiError(ValueError):
  """A request that cannot run (unknown runtime, missing or mismatched adapter, ...)."""


@dataclasses.dataclass
class Answer:
  """One decoded answer.

  Attributes:
    text: the final text (PASTA: logical order, tags dropped; cut before a stop string).
    token_ids: the generated ids (PASTA / TIP: canonical order, tags included; SoT: the
      final text re-encoded), without the stop token. A stop string ends AR-like decoding,
      so their ids end there; PASTA / TIP / SoT / APAR decode whole and only ``text`` is cut.
    finish_reason: ``"stop"``, ``"length"`` or ``"degraded"``
      (:mod:`selforch_jax.runtime.generation`).
    forwards: engine steps that ran a token of this answer (prefill included).
    tokens_per_forward: tokens the engine ran for this answer per forward (AR: 1.0).
    wall_s: seconds of the job that decoded it (a batch shares one figure).
    prompt_tokens: tokens of the prompt.
    logprobs: natural-log probability of each of ``token_ids`` (empty for SoT / APAR).
    figures: the runtime's own figures (PASTA: threads, rounds, theoretical speedup, ...;
      PASTA / TIP: ``raw``, the tagged output; KV policies: live KV tokens; SoT: points;
      APAR: forks).
  """

  text: str
  token_ids: list[int]
  finish_reason: str
  forwards: int
  tokens_per_forward: float
  wall_s: float
  prompt_tokens: int = 0
  logprobs: list[float] = dataclasses.field(default_factory=list)
  figures: dict = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def check_adapter(adapter: str, preset: str | None = None, runtime: str | None = None) -> dict:
  """Check an adapter directory without loading weights; returns its ``model`` section.

  Raises:
    ApiError: no such directory, not an adapter directory, made for another model preset than
      ``preset``, without the orchestration tags for a tagged ``runtime``, or not an Orthrus
      adapter for ``runtime="orthrus"``.
  """
  from selforch_jax.adapter import CONFIG_FILE
  if not os.path.isdir(adapter):
    raise ApiError(f"adapter {adapter!r}: no such directory")
  path = os.path.join(adapter, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ApiError(f"adapter {adapter!r} is not an adapter directory (no {CONFIG_FILE}; make one "
                   "with python -m selforch_jax.export --workdir=RUN --out=DIR --adapter)")
  try:
    with open(path, encoding="utf-8") as f:
      meta = json.load(f)
    mc, kind = meta["model"], meta.get("kind", "lora")
  except (OSError, ValueError, KeyError) as e:
    raise ApiError(f"adapter {adapter!r}: unreadable {CONFIG_FILE} ({e})") from None
  if preset is not None and mc.get("preset") != preset:
    raise ApiError(f"adapter {adapter!r} is for model {mc.get('preset')!r}, not {preset!r}")
  if runtime in TAGGED_RUNTIMES and not mc.get("tags", False):
    raise ApiError(f"adapter {adapter!r} was trained without the orchestration tags: runtime "
                   f"{runtime!r} needs them")
  if runtime == "orthrus" and kind != "orthrus":
    raise ApiError(f"adapter {adapter!r} is not an Orthrus adapter (no diffusion view): runtime "
                   "'orthrus' needs one")
  if runtime == "sol" and kind != "sol":
    raise ApiError(f"adapter {adapter!r} is not a SOL policy adapter: runtime 'sol' needs one")
  if runtime == "tip" and mc.get("tags", False) and int(mc.get("num_registers", 0)) < 1:
    raise ApiError(f"adapter {adapter!r} has no thought registers: runtime 'tip' needs them")
  return mc


def resolve_adapter(runtime: str, adapter: str | None, preset: str) -> str:
  """The adapter a runtime uses: ``adapter``, else the default one for ``(runtime, preset)``
  (:data:`DEFAULT_ADAPTERS`, when present), else ``""``.

  Raises:
    ApiError: unknown runtime, or a tagged runtime (``tip``; ``pasta`` without its default)
      with no adapter (the message names what is missing).
  """
  if runtime not in RUNTIMES:
    raise ApiError(f"unknown runtime {runtime!r}; valid: {', '.join(RUNTIMES)}")
  if adapter:
    check_adapter(adapter, preset, runtime)
    return adapter
  default = DEFAULT_ADAPTERS.get((runtime, preset), "")
  if default and os.path.isfile(os.path.join(default, "adapter_config.json")):
    return default
  if runtime == "orthrus":
    raise ApiError("runtime 'orthrus' needs an Orthrus adapter (the trained diffusion view): pass "
                   "--config.adapter=DIR / adapter=DIR (e.g. adapters/orthrus_smollm2_135m)")
  if runtime == "sol":
    raise ApiError("runtime 'sol' needs a SOL policy adapter: pass --config.adapter=DIR / "
                   "adapter=DIR (e.g. adapters/sol_smollm2_135m)")
  if runtime in TAGGED_RUNTIMES:
    raise ApiError(f"runtime {runtime!r} needs a model with the orchestration tags: pass an "
                   f"adapter (--config.adapter=DIR / adapter=DIR) trained for {runtime}; "
                   f"there is none by default for model {preset!r}")
  return ""


def load(config: Any = "configs/smollm2_135m.py", adapter: str | None = None,
         runtime: str = "ar"):
  """``(model, tokenizer, TagVocab or None, model config section)`` for a runtime.

  Args:
    config: a config file path (``get_config()``) or a decode ConfigDict.
    adapter: an adapter directory (None: the runtime's default, :func:`resolve_adapter`).

  Raises:
    ApiError: as :func:`resolve_adapter`; a model without a tokenizer.
  """
  from selforch_jax import config_lib
  from selforch_jax.lang import TagVocab
  if isinstance(config, str):
    config = load_config_file(config)
  adapter = resolve_adapter(runtime, adapter, config.model.preset)
  if adapter:
    from selforch_jax.adapter import load_adapter
    model, tok = load_adapter(adapter)
  else:
    _, model, tok = config_lib.load_model(config.model)
  if tok is None:
    raise ApiError("the model has no tokenizer; set model.tokenizer")
  tv = TagVocab.from_tokenizer(tok) if tok.token_to_id("<promise>") is not None else None
  return model, tok, tv, config


def load_config_file(path: str, arg: str | None = None):
  """``get_config(arg)`` of a config file (``"configs/X.py"`` or ``"configs/X.py:arg"``).

  Raises:
    ApiError: no such file, or no ``get_config`` in it.
  """
  from selforch_jax import config_lib
  try:
    return config_lib.load_config_file(path, arg)
  except config_lib.ConfigError as e:
    raise ApiError(str(e)) from None


def _tip_registers(tv) -> int:
  return len(tv.registers) if tv is not None else 0


def _pool(runtime: str, prompt_lens: list[int], max_new: int, options: dict, tv) -> dict:
  """``make_engine`` arguments for one job of ``runtime``."""
  from selforch_jax.runtime.schedulers.pasta import DEFAULT_MAX_THREADS, POOL_TAG_TOKENS
  if runtime == "pasta":
    return dict(prompt_lens=prompt_lens, max_new_tokens=max_new,
                threads=int(options.get("max_threads") or DEFAULT_MAX_THREADS),
                extra_tokens=POOL_TAG_TOKENS)
  if runtime == "tip":
    return dict(prompt_lens=prompt_lens, max_new_tokens=max_new,
                threads=_tip_registers(tv) + 6)
  if runtime == "sot":   # sequential stages; stage 2 holds every point prompt of every question
    pts = int(options.get("max_points", 10))
    sk = int(options.get("skeleton_tokens", min(96, max_new)))
    return dict(prompt_lens=[n + 256 + sk for n in prompt_lens for _ in range(pts)],
                max_new_tokens=int(options.get("point_tokens", min(64, max_new))), check=False)
  if runtime == "apar":  # one prompt at a time; each child ends in a page of its own
    return dict(prompt_lens=[max(prompt_lens)], max_new_tokens=max_new,
                threads=int(options.get("max_forks", 8)) + 1)
  if runtime == "planned_diffusion":   # a scratch owner holds at most one round's scaffold
    return dict(prompt_lens=prompt_lens, max_new_tokens=max_new, threads=2,
                extra_tokens=max_new + 16)
  if runtime in SPECULATIVE_RUNTIMES:
    # a step that accepts guesses relabels their pages into the sequence (at worst one page per
    # generated token), and the tree step's owner needs pages for up to 64 tree tokens
    return dict(prompt_lens=prompt_lens, max_new_tokens=max_new, threads=max_new + 4,
                extra_tokens=64)
  return dict(prompt_lens=prompt_lens, max_new_tokens=max_new)


def _finish(result, notes: Sequence[str]) -> str:
  """``"degraded"`` when the parser repaired the answer's annotations other than closing what
  was still open when it reached ``max_new_tokens`` (those are ``"length"``)."""
  if not notes:
    return result.finish_reason if result.finish_reason in ("stop", "length", "degraded") \
        else "stop"
  if result.finish_reason == "length" and all(n.startswith("end:") for n in notes):
    return "length"
  return "degraded"


def decode_ids(model, tokenizer, prompts: Sequence[Sequence[int]], *, runtime: str = "ar",
               max_new_tokens: int | None = None, sampling=None, stop: Sequence[str] = (),
               tag_vocab=None, questions: Sequence[str] | None = None, page_size: int = 16,
               batch_size: int | None = None, options: dict | None = None,
               on_token: Callable[[int, int], None] | None = None,
               on_answer: Callable[[int, Answer], None] | None = None,
               trace: Any = "") -> list[Answer]:
  """Decode token-id prompts with ``runtime`` on engines built by
  :func:`selforch_jax.runtime.build.make_engine`.

  Args:
    model / tokenizer: the model and its tokenizer (``decode``, ``stop_ids``).
    prompts: B non-empty lists of int token ids (chat-formatted).
    runtime: one of :data:`RUNTIMES`.
    max_new_tokens: tokens per answer (PASTA / TIP: tags included); None or 0: the runtime's
      default (:func:`default_max_new_tokens`).
    sampling: :class:`~selforch_jax.runtime.sampling.SamplingParams` (None: greedy).
    stop: stop strings (AR-like runtimes stop decoding at one; every runtime's text is cut
      before the first one, finish reason ``"stop"``).
    tag_vocab: the model's :class:`~selforch_jax.lang.tags.TagVocab` (pasta, tip).
    questions: the user instructions (SoT writes its own prompts; default: decoded prompts).
    page_size: KV page size. batch_size: prompts per job (None: all at once; SoT / APAR /
      PASTA run their own batches inside one job).
    options: the runtime's own options (PASTA: cap, constrain_tags, max_threads,
      max_topic_tokens; SoT: skeleton_tokens, point_tokens, max_points; APAR: child_tokens,
      max_forks; streaming_llm / h2o: budget, n_sink, recent_ratio; orthrus: block_size, fused,
      fuse_at, denoise_steps;
      planned_diffusion: :data:`PD_OPTIONS`; sol: ``policy`` (a SOL adapter directory, or
      ``(policy, grid, sparsity)``), ``budget`` (``"kappa,rho,bits"``, default
      ``0.5,0.8,8``) and ``budget_guard`` (the decode-time budget guard's tolerance in usage
      units, default :data:`~selforch_jax.runtime.sol_control.DEFAULT_BUDGET_GUARD`; 0 or None:
      off, the policy's own actions; :class:`~selforch_jax.runtime.sol_control.
      BudgetController`)).
    on_token: ``callback(prompt index, token id)`` as tokens are sampled (AR-like runtimes).
    on_answer: ``callback(prompt index, Answer)`` as each job finishes.
    trace: ``""`` (off); a path ending in ``.html`` / ``.png`` / ``.json``: every engine step
      of every job is recorded (:class:`~selforch_jax.runtime.trace.TraceRecorder`) and drawn
      there at the end (:func:`selforch_jax.trace_render.render`); or a ``TraceRecorder``,
      which records the steps (each job attached in turn) and is left for the caller to render.

  Returns:
    One :class:`Answer` per prompt.

  Raises:
    ApiError: unknown runtime; a tagged runtime without ``tag_vocab``; a ``trace`` path with
      another extension (before anything runs).
    ContextLengthError: a prompt plus ``max_new_tokens`` exceeds the model's context.
    ValueError: an empty prompt or a bad option.
  """
  from selforch_jax.runtime.build import make_engine
  from selforch_jax.runtime.generation import check_context, cut_at_stop, eos_ids
  from selforch_jax.runtime.sampling import SamplingParams
  from selforch_jax.runtime.scheduler import run
  from selforch_jax.runtime.schedulers import make_scheduler

  if runtime not in RUNTIMES:
    raise ApiError(f"unknown runtime {runtime!r}; valid: {', '.join(RUNTIMES)}")
  if runtime in TAGGED_RUNTIMES and tag_vocab is None:
    raise ApiError(f"runtime {runtime!r} needs a model with the orchestration tags (an adapter)")
  prompts = [[int(t) for t in p] for p in prompts]
  if not prompts or any(not p for p in prompts):
    raise ValueError("decode_ids needs at least one prompt, none empty")
  max_new_tokens = default_max_new_tokens(runtime, max_new_tokens)
  check_context([len(p) for p in prompts], max_new_tokens, model.cfg.max_position_embeddings)
  sampling = sampling or SamplingParams()
  options = dict(options or {})
  stop = tuple(s for s in stop if s)
  stops = eos_ids(tokenizer)
  recorder = _recorder(trace, tokenizer, runtime)
  decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
  if questions is None:
    questions = [decode(p) for p in prompts]
  B = len(prompts)
  bs = B if runtime in ("sot", "apar") or not batch_size else int(batch_size)
  batches = [list(range(s, min(s + bs, B))) for s in range(0, B, bs)]
  lens = [len(p) for p in prompts]
  pool = _pool(runtime, [max(lens)] * len(batches[0]), max_new_tokens, options, tag_vocab)
  attention = "reference" if runtime in ("h2o", "paged_h2o") else "auto"
  engine = make_engine(model, page_size=page_size, attention=attention, **pool)
  out: list[Answer | None] = [None] * B
  sol_policy = _sol_policy(options) if runtime == "sol" else None
  for rows in batches:
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stops)
    if runtime in ("ar", "tip", "streaming_llm", "h2o", "sol"):
      kw.update(stop_strings=stop, decode=decode,
                on_token=(None if on_token is None else
                          (lambda r, t, rows=rows: on_token(rows[r], t))))
    if runtime in ("streaming_llm", "h2o"):
      kw["budget"] = int(options.get("budget", DEFAULT_KV_BUDGET))
      for k in ("n_sink", "recent_ratio"):
        if k in options and (k == "n_sink") == (runtime == "streaming_llm"):
          kw[k] = options[k]
    elif runtime == "pasta":
      kw["tag_vocab"] = tag_vocab
      kw.update({k: options[k] for k in ("cap", "constrain_tags", "max_threads",
                                         "max_topic_tokens") if k in options})
    elif runtime == "tip":
      kw["tag_vocab"] = tag_vocab
    elif runtime == "planned_diffusion":
      kw["tag_vocab"] = tag_vocab
      kw.update({k: options[k] for k in PD_OPTIONS if k in options})
    elif runtime == "sot":
      kw.update(tokenizer=tokenizer, questions=[questions[i] for i in rows])
      kw.update({k: options[k] for k in ("skeleton_tokens", "point_tokens", "max_points")
                 if k in options})
    elif runtime == "apar":
      kw["tokenizer"] = tokenizer
      kw.update({k: options[k] for k in ("child_tokens", "max_forks") if k in options})
    elif runtime == "orthrus":   # the adapter's <|mask|> (None: the model's last row)
      from selforch_jax.models.orthrus import MASK_TOKEN
      kw["mask_id"] = tokenizer.token_to_id(MASK_TOKEN)
      if "block_size" in options:
        kw["block_size"] = int(options["block_size"])
      if "fused" in options:
        kw["fused"] = bool(options["fused"])
      if "fuse_at" in options:
        kw["fuse_at"] = int(options["fuse_at"] or 0)
      if "denoise_steps" in options:
        kw["denoise_steps"] = int(options["denoise_steps"])
    elif runtime == "sol":
      from selforch_jax.runtime.sol_control import DEFAULT_BUDGET_GUARD, budget_guard_option
      kw.update(policy=sol_policy[0], grid=sol_policy[1], sparsity=sol_policy[2],
                budget=options.get("budget", "0.5,0.8,8"),
                budget_guard=budget_guard_option(options.get("budget_guard",
                                                             DEFAULT_BUDGET_GUARD)))
    sched = make_scheduler(runtime, engine, [prompts[i] for i in rows], **kw)
    if recorder is not None:
      recorder.attach(sched)
    t0 = time.perf_counter()
    run(engine, sched, observer=recorder)
    wall = time.perf_counter() - t0
    for o in getattr(sched, "owners", ()):
      engine.pool.free_owner(int(o))
    for j, i in enumerate(rows):
      a = _answer(runtime, sched, j, tokenizer, tag_vocab, decode, wall)
      a.prompt_tokens = len(prompts[i])
      text, cut = cut_at_stop(a.text, stop)
      if cut:
        a.text, a.finish_reason = text, "stop"
      out[i] = a
      if on_answer is not None:
        on_answer(i, a)
  if recorder is not None and isinstance(trace, str):
    from selforch_jax.trace_render import render
    render(recorder, trace)
  return out


def _sol_policy(options: dict) -> tuple:
  """``(policy, grid, sparsity)`` of ``options["policy"]``: a SOL adapter directory (loaded) or
  that tuple.

  Raises:
    ApiError: no policy given, or not a SOL adapter; a bad ``budget`` or ``budget_guard``."""
  from selforch_jax.runtime.sol_actions import parse_budget
  from selforch_jax.runtime.sol_control import budget_guard_option
  pol = options.get("policy")
  if pol is None or (isinstance(pol, str) and not pol):
    raise ApiError("runtime 'sol' needs options['policy']: a SOL adapter directory")
  try:
    parse_budget(options.get("budget", "0.5,0.8,8"))
    budget_guard_option(options.get("budget_guard"))
  except ValueError as e:
    raise ApiError(str(e)) from None
  if isinstance(pol, (tuple, list)):
    return tuple(pol)
  from selforch_jax.sol_adapter import load_sol_policy
  try:
    return load_sol_policy(str(pol))[:3]
  except (OSError, ValueError) as e:
    raise ApiError(f"SOL policy {pol!r}: {e}") from None


def _recorder(trace: Any, tokenizer, runtime: str):
  """The :class:`~selforch_jax.runtime.trace.TraceRecorder` for ``decode_ids(trace=...)``, or
  None when ``trace`` is empty.

  Raises:
    ApiError: a path without a known extension (:data:`selforch_jax.trace_render.FORMATS`).
  """
  from selforch_jax.runtime.trace import TraceRecorder
  if trace is None or (isinstance(trace, str) and not trace):
    return None
  if isinstance(trace, TraceRecorder):
    return trace
  from selforch_jax.trace_render import FORMATS
  if not isinstance(trace, str) or os.path.splitext(trace)[1].lower() not in FORMATS:
    raise ApiError(f"trace={trace!r}: give a path ending in {', '.join(FORMATS)} (or a "
                   "TraceRecorder)")
  return TraceRecorder(token_text=lambda t: tokenizer.decode([int(t)]), title=runtime)


def _answer(runtime, sched, j, tok, tv, decode, wall) -> Answer:
  """The :class:`Answer` of row ``j`` of a finished scheduler."""
  res = sched.results[j]
  ids = list(res.token_ids)
  stopped = res.finish_reason == "stop"
  if runtime == "pasta":
    st = sched.stats[j]
    figs = dict(threads=st.threads, rounds=st.rounds, max_parallel=st.max_parallel,
                theoretical_speedup=round(st.theoretical_speedup, 4),
                content_tokens=st.content_tokens, well_formed=st.well_formed,
                degraded=list(st.degraded), raw=tokenizer_raw(tok, ids))
    return Answer(sched.text(j, tok), ids, _finish(res, st.degraded), st.forwards,
                  st.tokens_per_forward, st.wall_s if st.wall_s else wall,
                  logprobs=list(res.logprobs), figures=figs)
  if runtime == "planned_diffusion":
    st = sched.stats[j]
    figs = dict(raw=tokenizer_raw(tok, ids), rounds=st["rounds"],
                critical_path=st["critical_path"], ar_steps=st["ar_steps"],
                denoise_steps=st["denoise_steps"], chunks=st["chunks"],
                content_tokens=st["content_tokens"], well_formed=st["well_formed"],
                degraded=list(st["notes"]))
    return Answer(sched.text(j, tok), ids, _finish(res, st["notes"]), st["forwards"],
                  st["tokens"] / max(st["forwards"], 1), st["wall_s"] or wall,
                  logprobs=list(res.logprobs), figures=figs)
  if runtime == "sot":
    st = sched.stats[j]
    fw = max(st["forwards"], 1)
    return Answer(sched.texts[j], ids, res.finish_reason, st["forwards"], st["tokens"] / fw,
                  wall, figures=dict(points=st["points"], parsed=st["parsed"],
                                     tokens=st["tokens"]))
  if runtime == "apar":
    r = sched.apar[j]
    fw = max(r.forwards, 1)
    return Answer(decode(ids), ids, res.finish_reason, r.forwards, r.tokens / fw, r.wall_s,
                  figures=dict(forks=r.forks, max_parallel=r.max_parallel, tokens=r.tokens))
  if runtime in SPECULATIVE_RUNTIMES:
    st = sched.stats[j]
    figs = {k: v for k, v in st.items() if k not in ("forwards", "tokens_per_forward")
            and isinstance(v, (int, float, str))}
    return Answer(decode(ids), ids, res.finish_reason, int(st["forwards"]),
                  float(st["tokens_per_forward"]), wall, logprobs=list(res.logprobs),
                  figures=figs)
  tokens = len(ids) + int(stopped)
  figs: dict = {}
  notes: tuple = ()
  if getattr(sched, "kv_stats", None) is not None:
    kv = sched.kv_stats[j]
    figs.update(mean_live_kv_tokens=round(kv["mean_live_tokens"], 2),
                peak_live_kv_tokens=kv["peak_live_tokens"],
                peak_live_kv_bytes=kv["peak_live_bytes"])
    forwards = int(kv["steps"]) or tokens
  else:
    forwards = tokens
  text_ids = ids
  if runtime == "sol":
    figs.update(sched.budget(j))
  if runtime == "tip":
    from selforch_jax.lang import assemble
    notes = tuple(sched.layout(j).notes)
    figs.update(degraded=list(notes), raw=tokenizer_raw(tok, ids))
    text_ids = assemble(ids, tv)
  return Answer(decode(text_ids), ids, _finish(res, notes), forwards,
                tokens / max(forwards, 1), wall, logprobs=list(res.logprobs), figures=figs)


def tokenizer_raw(tok, ids: Sequence[int]) -> str:
  """The tagged text of ``ids`` (tags written out): what PASTA / TIP rows carry as ``raw``."""
  return tok.decode(list(ids))


def generate(prompts: str | Sequence[str], runtime: str = "ar", adapter: str | None = None, *,
             max_new_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (),
             config: Any = "configs/smollm2_135m.py", model: Any = None,
             tokenizer: Any = None, system_prompt: str = "", options: dict | None = None,
             on_token: Callable[[int, int], None] | None = None,
             trace: Any = "") -> list[Answer]:
  """Decode user prompts with a runtime; one :class:`Answer` per prompt.

  Args:
    prompts: one user prompt or a list of them (each becomes a chat turn).
    runtime: one of :data:`RUNTIMES`.
    adapter: an adapter directory (PASTA: default ``adapters/pasta_smollm2_135m`` when present;
      TIP needs one).
    max_new_tokens, temperature, top_k, top_p, min_p, seed: decoding budget (None: the
      runtime's default, 512 for pasta / tip, 128 otherwise) and sampling
      (:class:`~selforch_jax.runtime.sampling.SamplingParams`; temperature 0 = greedy).
    stop: stop strings (PASTA: the logical-order text is cut at the first one, so a stop
      string that can occur inside the answer, such as a blank line, cuts its threads off).
    config: a config file or ConfigDict naming the model (ignored when ``model`` is given).
    model / tokenizer: an already loaded model and its tokenizer (then ``adapter`` and
      ``config`` are not read).
    system_prompt: an optional system turn.
    options: the runtime's own options (:func:`decode_ids`).
    on_token: streaming callback ``(prompt index, token id)``.
    trace: a ``.html`` / ``.png`` / ``.json`` path where the decode's step timeline is drawn
      (or a ``TraceRecorder``; :func:`decode_ids`).

  Returns:
    list of :class:`Answer` (text, token ids, finish reason, forwards, tokens per forward,
    wall seconds, the runtime's figures).

  Raises:
    ApiError: unknown runtime, adapter missing / for another model, empty prompt.
    ContextLengthError: a prompt too long for the model's context.
    ValueError: bad sampling values.
  """
  from selforch_jax.runtime.sampling import SamplingParams
  if isinstance(prompts, str):
    prompts = [prompts]
  if not prompts or any(not str(p).strip() for p in prompts):
    raise ApiError("every prompt must be a non-empty string")
  if runtime not in RUNTIMES:
    raise ApiError(f"unknown runtime {runtime!r}; valid: {', '.join(RUNTIMES)}")
  sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed)
  if model is None:
    model, tokenizer, tv, cfg = load(config, adapter, runtime)
    if runtime == "sol":
      options = dict(options or {})
      options.setdefault("policy", resolve_adapter(runtime, adapter, cfg.model.preset))
  else:
    if tokenizer is None:
      raise ApiError("generate(model=...) needs tokenizer= too")
    from selforch_jax.lang import TagVocab
    tv = (TagVocab.from_tokenizer(tokenizer)
          if tokenizer.token_to_id("<promise>") is not None else None)
  msgs = [([{"role": "system", "content": system_prompt}] if system_prompt else [])
          + [{"role": "user", "content": str(p)}] for p in prompts]
  ids = [tokenizer.encode_chat(m, add_generation_prompt=True) for m in msgs]
  return decode_ids(model, tokenizer, ids, runtime=runtime, max_new_tokens=max_new_tokens,
                    sampling=sampling, stop=stop, tag_vocab=tv, questions=list(prompts),
                    options=options, on_token=on_token, trace=trace)
