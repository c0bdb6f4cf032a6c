"""bench/training_curve.py: eval rows per step (last logged wins), flattening step, CLI errors."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import training_curve  # noqa: E402


def _write(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def test_curve_last_row_wins_and_flattening(tmp_path):
  p = tmp_path / "metrics.jsonl"
  _write(p, [{"step": 0, "eval_accept_len": 1.0}, {"step": 1, "loss": 3.0},
             {"step": 10, "eval_accept_len": 1.5}, {"step": 20, "eval_accept_len": 1.9},
             {"step": 10, "eval_accept_len": 1.6},      # a resumed run re-logged step 10
             {"step": 30, "eval_accept_len": 2.0}, {"step": 40, "eval_accept_len": 1.95}])
  c = training_curve.read_curve(str(p), ["eval_accept_len"])
  assert c["step"] == [0, 10, 20, 30, 40]
  assert c["eval_accept_len"] == [1.0, 1.6, 1.9, 2.0, 1.95]
  assert training_curve.flattens_at(c["step"], c["eval_accept_len"], 0.05) == 20
  assert training_curve.flattens_at(c["step"], c["eval_accept_len"], 0.01) == 30


def test_cli_writes_json_and_png(tmp_path):
  p = tmp_path / "metrics.jsonl"
  _write(p, [{"step": s, "eval_accept_len": 1 + s / 10, "eval_match": s / 100}
             for s in (0, 5, 10)])
  out = tmp_path / "curve.json"
  assert training_curve.main([f"--metrics={p}", f"--out={out}"]) == 0
  d = json.load(open(out))
  assert d["final"]["eval_accept_len"] == pytest.approx(2.0)
  assert d["max_step"]["eval_match"] == 10
  assert os.path.getsize(tmp_path / "curve.png") > 0


def test_cli_missing_key_is_exit_2(tmp_path, capsys):
  p = tmp_path / "metrics.jsonl"
  _write(p, [{"step": 0, "loss": 1.0}])
  assert training_curve.main([f"--metrics={p}", "--keys=eval_accept_len",
                              f"--out={tmp_path / 'c.json'}"]) == 2
  assert "no row carries" in capsys.readouterr().err
