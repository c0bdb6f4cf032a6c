"""The Colab notebooks run top to bottom (on the toy-width model, so the test stays fast)."""

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_cells(path):
  nb = json.load(open(path))
  for cell in nb["cells"]:
    if cell["cell_type"] == "code":
      src = "".join(cell["source"])
      # shell / magic lines are Colab set-up (pip installs); the test env has the package
      yield "\n".join(l for l in src.splitlines() if not l.lstrip().startswith(("!", "%")))


def test_notebook_committed_with_outputs():
  """The committed notebook holds the outputs of a run on the real model: the answers, the
  plot and the trace as PNG outputs (GitHub shows them)."""
  nb = json.load(open(os.path.join(ROOT, "colab", "quickstart.ipynb")))
  code = [c for c in nb["cells"] if c["cell_type"] == "code"]
  params = next(c for c in code if "".join(c["source"]).startswith("# parameters"))
  assert 'MODEL = "smollm2_135m"' in "".join(params["source"])
  pngs = [o for c in code for o in c["outputs"] if "image/png" in o.get("data", {})]
  assert len(pngs) == 2   # the AR vs PASTA plot, the PASTA trace
  texts = "".join("".join(o.get("text", "")) for c in code for o in c["outputs"])
  assert "Paris" in texts and "threads" in texts
  assert not any(o.get("output_type") == "error" for c in code for o in c["outputs"])


@pytest.mark.parametrize("name", ["quickstart.ipynb"])
def test_notebook_runs(name, tmp_path, monkeypatch):
  import matplotlib
  matplotlib.use("Agg")
  import IPython.display
  shown = []   # what the notebook displays (outside a kernel display() would print a repr)
  monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
  monkeypatch.chdir(ROOT)
  trace_png = str(tmp_path / "trace" / "pasta.png")
  ns = {}
  for src in code_cells(os.path.join(ROOT, "colab", name)):
    for old, new in [('MODEL = "smollm2_135m"', 'MODEL = "tiny_smollm2"'),
                     ("MAX_NEW_TOKENS = 128", "MAX_NEW_TOKENS = 8"),
                     ('PASTA_ADAPTER = "adapters/pasta_smollm2_135m"', 'PASTA_ADAPTER = ""'),
                     ('TRACE_PNG = "out/colab/pasta_trace.png"', f"TRACE_PNG = {trace_png!r}")]:
      src = src.replace(old, new)
    exec(compile(src, name, "exec"), ns)
  assert ns["MODEL"] == "tiny_smollm2" and ns["PASTA_ADAPTER"] == ""
  n = len(ns["questions"])
  assert len(ns["texts"]) == n == 3
  assert all(len(r.token_ids) <= 8 and r.forwards >= 1 for r in ns["results"])
  assert [r.finish_reason in ("stop", "length") for r in ns["results"]] == [True] * n
  assert ns["stats"]["tokens_per_s"] > 0
  # PASTA on the tagged toy model: one answer per prompt, with the runtime's figures
  assert len(ns["pasta"]) == n
  for r in ns["pasta"]:
    assert r.forwards >= 1 and r.tokens_per_forward > 0 and "threads" in r.figures
    assert r.finish_reason in ("stop", "length", "degraded")
  # the plot's bars are the figures of the answers the notebook measured
  runs = ns["runs"]
  assert set(runs) == {"ar", "pasta"} and all(len(a) == n for a in runs.values())
  ax1, ax2 = ns["fig"].axes
  assert len(ax1.containers) == 2
  for bars, rt in zip(ax1.containers, ("ar", "pasta")):
    assert [b.get_height() for b in bars] == pytest.approx(
        [r.tokens_per_forward for r in runs[rt]])
  assert [b.get_height() for b in ax1.containers[0]] == pytest.approx([1.0] * n)  # AR
  walls = [b.get_height() for b in ax2.containers[0]]
  assert walls == pytest.approx([max(r.wall_s for r in runs[rt]) for rt in ("ar", "pasta")])
  assert all(w > 0 for w in walls)
  # the trace of one PASTA decode was drawn to PNG and displayed
  assert os.path.getsize(trace_png) > 0
  with open(trace_png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert len(shown) == 1 and isinstance(shown[0], IPython.display.Image)
  assert shown[0].filename == trace_png and shown[0].data == open(trace_png, "rb").read()
  assert len(ns["traced"]) == 1 and ns["traced"][0].forwards >= 1
