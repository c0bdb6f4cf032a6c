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


@pytest.mark.parametrize("name", ["quickstart.ipynb"])
def test_notebook_runs(name):
  ns = {}
  for src in code_cells(os.path.join(ROOT, "colab", name)):
    src = src.replace('MODEL = "smollm2_135m"', 'MODEL = "tiny_smollm2"')
    src = src.replace("MAX_NEW_TOKENS = 64", "MAX_NEW_TOKENS = 8")
    exec(compile(src, name, "exec"), ns)
  assert ns["MODEL"] == "tiny_smollm2"
  assert len(ns["texts"]) == 2
  assert all(len(r.token_ids) <= 8 and r.forwards >= 1 for r in ns["results"])
  assert [r.finish_reason in ("stop", "length") for r in ns["results"]] == [True, True]
  assert ns["stats"]["tokens_per_s"] > 0
