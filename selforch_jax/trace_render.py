"""Draw a decode trace (:class:`selforch_jax.runtime.trace.TraceRecorder`) as a timeline.

One row per engine step; each token of the step is a coloured box with its text, coloured by
its group (``prompt``, ``answer``, PASTA ``main`` / ``thread k``, TIP ``reg k``, SoT ``skeleton``
/ ``point k``, APAR ``main`` / ``item k``); markers say where threads fork (⑂) and join (⋈), what
the plan evicted (✂), released (free), rolled back (↶) or rejected (✗), and which steps were
scratch (verify) steps; a token whose K/V a later step evicted / rejected / rolled back is drawn
struck through, and its tooltip says which step did it.

:func:`render` picks the format from the path: ``.html`` (self-contained: inline CSS, no
external assets), ``.png`` (matplotlib, Agg) or ``.json`` (the recorder's ``to_dict``).
"""

from __future__ import annotations

import html
import os
from typing import Any

__all__ = ["FORMATS", "render", "to_html", "to_png", "group_colors", "png_size"]

FORMATS = (".html", ".png", ".json")
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#86bcb6", "#d37295", "#8cd17d", "#a0cbe8", "#ffbe7d")
PROMPT_COLOR = "#d9d9d9"
MAX_TOKENS = 64        # longer rows (a long prompt) show their first and last HEAD tokens
HEAD = 24
ROW_IN, HEADER_IN, DPI = 0.22, 1.2, 80     # PNG: inches per step row, header inches, dots/inch
TOKEN_IN = 0.32                             # PNG: inches per token box
FATE_MARK = {"evicted": "✂", "rejected": "✗", "rolled_back": "↶", "released": "",
             "scratch": "", "rewritten": "", "kept": ""}


def _rec(trace: Any):
  if hasattr(trace, "steps") and hasattr(trace, "groups"):
    return trace
  raise TypeError(f"expected a TraceRecorder, got {type(trace).__name__}")


def group_colors(groups) -> dict[str, str]:
  """``{group: colour}``: ``prompt`` light grey, the others the palette in order (cycled)."""
  out, k = {}, 0
  for g in groups:
    if g == "prompt":
      out[g] = PROMPT_COLOR
    else:
      out[g] = PALETTE[k % len(PALETTE)]
      k += 1
  return out


def _shown(tokens: list) -> tuple[list, int]:
  """The tokens a row shows and how many were left out of the middle."""
  if len(tokens) <= MAX_TOKENS:
    return list(tokens), 0
  return list(tokens[:HEAD]) + [None] + list(tokens[-HEAD:]), len(tokens) - 2 * HEAD


def _markers(st) -> list[tuple[str, str]]:
  """``(css class, text)`` of a step's markers, in a fixed order."""
  m = []
  if st.forks:
    m.append(("fork", f"⑂ fork ×{len(st.forks)}"))
  if st.joins:
    m.append(("join", f"⋈ join ×{len(st.joins)}"))
  if st.evicted:
    m.append(("evict", f"✂ evict {len(st.evicted)}"))
  freed = sum(st.freed.values())
  if freed:
    m.append(("free", f"free {freed} ({len(st.freed)} owner{'s' if len(st.freed) > 1 else ''})"))
  if st.rollback:
    m.append(("rollback", f"↶ rollback {sum(st.rollback.values())}"))
  if st.relabel:
    m.append(("accept", f"✓ accept {sum(n for n, _, _ in st.relabel)}"))
  elif st.accepted:
    m.append(("accept", f"✓ accept {len(st.accepted)}"))
  nrej = len(st.rejected) + st.rejected_earlier
  if nrej:
    m.append(("rejected", f"✗ rejected {nrej}"))
  if st.scratch:
    m.append(("scratch", "scratch"))
  for n in st.notes:
    m.append(("note", str(n)))
  return m


def _tok_text(t) -> str:
  s = t.text if t.text != "" else "∅"
  s = s.replace("\n", "↵").replace("\t", "⇥")
  return "".join(c if c.isprintable() or c == " " else f"\\x{ord(c):02x}" for c in s)


CSS = """
body{font-family:system-ui,sans-serif;font-size:13px;margin:12px;color:#222}
h1{font-size:16px;margin:0 0 6px}
.legend span.sw{display:inline-block;padding:1px 6px;margin:2px;border-radius:3px}
.legend{margin-bottom:8px;line-height:1.9}
.step{display:flex;flex-wrap:wrap;align-items:center;border-top:1px solid #eee;padding:2px 0}
.step.scratch{background:#f6f3ff}
.idx{width:44px;color:#888;font-family:monospace;text-align:right;margin-right:6px}
.kind{width:64px;color:#888;font-size:11px}
.tok{font-family:monospace;white-space:pre;padding:0 2px;margin:1px;border-radius:3px;
  border:1px solid rgba(0,0,0,.15)}
.tok.evicted,.tok.rolled_back,.tok.rejected{text-decoration:line-through;opacity:.55}
.tok.rejected{outline:2px solid #d62728}
.tok.released{opacity:.8}
.tok.scratch{border-style:dashed}
.tok.accepted{box-shadow:0 0 0 2px #2ca02c inset}
.gap{color:#888;font-style:italic;margin:0 4px}
.mark{font-size:11px;margin-left:6px;padding:0 4px;border-radius:3px;background:#eee}
.mark.fork{background:#d5f5d5}.mark.join{background:#d5e5ff}.mark.evict{background:#ffd9d9}
.mark.rejected{background:#ffc7c7}.mark.rollback{background:#ffe9c7}.mark.accept{background:#d9f7d9}
.mark.scratch{background:#e8e0ff}
"""


def to_html(trace: Any) -> str:
  """The trace as one self-contained HTML page (inline CSS; no scripts, no external assets):
  a legend of the colour groups and markers, then one ``<div class="step">`` per step.

  Raises:
    TypeError: ``trace`` is not a recorder.
  """
  rec = _rec(trace)
  colors = group_colors(rec.groups)
  c = rec.counts()
  out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>",
         html.escape(rec.title or "decode trace"), "</title><style>", CSS, "</style></head><body>",
         f"<h1>{html.escape(rec.title or 'decode trace')}</h1>",
         f"<div class='summary'>{html.escape(summary_line(c))}</div>",
         "<div class='legend'>groups: "]
  for g in rec.groups:
    out.append(f"<span class='sw' style='background:{colors[g]}'>{html.escape(g)}</span>")
  out.append("<br>markers: <span class='mark fork'>⑂ fork</span><span class='mark join'>⋈ join"
             "</span><span class='mark evict'>✂ evict</span><span class='mark free'>free</span>"
             "<span class='mark rollback'>↶ rollback</span><span class='mark accept'>✓ accept"
             "</span><span class='mark rejected'>✗ rejected</span><span class='mark scratch'>"
             "scratch</span>; struck-through token: its K/V was later evicted / rolled back / "
             "rejected (tooltip: which step)</div>")
  for st in rec.steps:
    cls = "step scratch" if st.scratch else "step"
    out.append(f"<div class='{cls}' data-step='{st.index}' data-job='{st.job}' "
               f"data-tokens='{len(st.tokens)}'><span class='idx'>{st.index}</span>"
               f"<span class='kind'>{html.escape(st.kind)}</span>")
    shown, gap = _shown(st.tokens)
    for t in shown:
      if t is None:
        out.append(f"<span class='gap'>… {gap} more …</span>")
        continue
      tcls = ["tok"] + ([t.fate] if t.fate != "kept" else []) + (["accepted"] if t.accepted else [])
      tip = (f"{t.group} · id {t.id} · pos {t.position} · seg {t.segment} · owner {t.owner}"
             f" · slot {t.slot}" + (f" · {t.fate} at step {t.fate_step}"
                                    if t.fate != "kept" else ""))
      out.append(f"<span class='{' '.join(tcls)}' style='background:{colors[t.group]}' "
                 f"title='{html.escape(tip, quote=True)}'>{html.escape(_tok_text(t))}</span>")
    for mc, text in _markers(st):
      out.append(f"<span class='mark {mc}'>{html.escape(text)}</span>")
    out.append("</div>")
  out.append("</body></html>")
  return "".join(out)


def png_size(trace: Any) -> tuple[int, int]:
  """``(height, width)`` in pixels of :func:`to_png`'s image of ``trace``."""
  rec = _rec(trace)
  width_tokens = max([len(_shown(st.tokens)[0]) for st in rec.steps] or [1])
  w_in = 2.0 + TOKEN_IN * width_tokens + 2.6
  h_in = HEADER_IN + ROW_IN * max(len(rec.steps), 1)
  return int(round(h_in * DPI)), int(round(w_in * DPI))


def to_png(trace: Any, path: str) -> dict:
  """Draw the trace with matplotlib (Agg) into ``path``: one row per step, one box per token
  coloured by group (no token text: boxes), fate marks on struck tokens, step markers at the
  row's end; legend at the top.

  Returns:
    what was drawn: ``rows`` (steps), ``boxes`` (token boxes), ``markers`` (``{class: count}``
    of :func:`to_html`'s marker classes), ``size`` (:func:`png_size`).

  Raises:
    TypeError: ``trace`` is not a recorder.
  """
  import matplotlib
  matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch, Rectangle

  rec = _rec(trace)
  colors = group_colors(rec.groups)
  h, w = png_size(rec)
  fig = plt.figure(figsize=(w / DPI, h / DPI), dpi=DPI)
  n = max(len(rec.steps), 1)
  top = 1.0 - HEADER_IN / (h / DPI)
  ax = fig.add_axes([0.0, 0.0, 1.0, top])
  width_tokens = max([len(_shown(st.tokens)[0]) for st in rec.steps] or [1])
  x0 = 2.0 / TOKEN_IN
  ax.set_xlim(0, x0 + width_tokens + 2.6 / TOKEN_IN)
  ax.set_ylim(n, 0)
  ax.axis("off")
  boxes, marks = 0, {}
  for r, st in enumerate(rec.steps):
    ax.text(x0 - 0.5, r + 0.5, f"{st.index} {st.kind[:7]}", ha="right", va="center", fontsize=7,
            color="#666")
    shown, _ = _shown(st.tokens)
    for j, t in enumerate(shown):
      if t is None:
        ax.text(x0 + j + 0.5, r + 0.5, "…", ha="center", va="center", fontsize=7)
        continue
      struck = t.fate in ("evicted", "rejected", "rolled_back")
      ax.add_patch(Rectangle((x0 + j + 0.05, r + 0.1), 0.9, 0.8, facecolor=colors[t.group],
                             edgecolor="#d62728" if t.fate == "rejected" else "none",
                             alpha=0.45 if struck else 1.0, linewidth=1.2,
                             linestyle="--" if t.fate == "scratch" else "-"))
      boxes += 1
      if struck:
        ax.plot([x0 + j + 0.1, x0 + j + 0.9], [r + 0.5, r + 0.5], color="#333", lw=0.8)
    text = []
    for mc, label in _markers(st):
      marks[mc] = marks.get(mc, 0) + 1
      text.append(label.replace("⑂ ", ""))   # no fork glyph in matplotlib's default font
    if text:
      ax.text(x0 + len(shown) + 0.5, r + 0.5, "  ".join(text), ha="left", va="center",
              fontsize=7, color="#333")
  handles = [Patch(facecolor=colors[g], label=g) for g in rec.groups]
  if handles:
    fig.legend(handles=handles, loc="upper left", ncol=min(len(handles), 8), fontsize=7,
               frameon=False)
  c = rec.counts()
  fig.text(0.99, 1.0 - 0.25 / (h / DPI), f"{rec.title}  {summary_line(c)}", ha="right",
           va="top", fontsize=8)
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return dict(rows=len(rec.steps), boxes=boxes, markers=marks, size=(h, w))


def summary_line(c: dict) -> str:
  """The one-line totals of :meth:`~selforch_jax.runtime.trace.TraceRecorder.counts` both
  pictures print: steps, tokens, forks, joins and every token fate (evicted: dropped by a KV
  policy; released: its owner freed, e.g. a TIP register; rolled back; rejected drafts)."""
  return (f"{c['steps']} steps, {c['tokens']} tokens, {c['forks']} forks, {c['joins']} joins, "
          f"{c['evicted']} evicted, {c['released']} released, {c['rolled_back']} rolled back, "
          f"{c['rejected']} rejected, {c['scratch_steps']} scratch steps")


def render(trace: Any, path: str) -> str:
  """Write ``trace`` to ``path`` as HTML, PNG or JSON by its extension (:data:`FORMATS`);
  creates the parent directory. Returns ``path``.

  Raises:
    ValueError: another extension. TypeError: ``trace`` is not a recorder.
  """
  ext = os.path.splitext(str(path))[1].lower()
  if ext not in FORMATS:
    raise ValueError(f"trace path {path!r} must end in {', '.join(FORMATS)}")
  rec = _rec(trace)
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  if ext == ".html":
    with open(path, "w", encoding="utf-8") as f:
      f.write(to_html(rec))
  elif ext == ".png":
    to_png(rec, path)
  else:
    rec.save_json(path)
  return path
