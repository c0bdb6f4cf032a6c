"""Smoke test of bench/engine_step.py on a tiny random model."""

from __future__ import annotations

import json
import math

from tests.repo_files import load_module


def _load_bench():
  return load_module("bench/engine_step.py")


def test_engine_step_bench_smoke(tmp_path):
  out = _load_bench().main([f"--out={tmp_path}", "--smoke", "--T=1,2,4", "--repeats=2"])
  data = json.loads((tmp_path / "engine_step.json").read_text())
  assert data == json.loads(json.dumps(out))
  assert data["config"]["smoke"] and data["config"]["T"] == [1, 2, 4]
  assert data["config"]["context_tokens"] == 32 and data["config"]["slots"] == 192
  for key in ("ms", "min_ms", "run_step_ms", "relative_to_T1", "query_tokens_per_s", "compile_s"):
    assert set(data[key]) == {"1", "2", "4"}, key
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in data[key].values())
  assert data["relative_to_T1"]["1"] == 1.0
  assert data["relative_per_token"]["4"] == data["relative_to_T1"]["4"] / 4
  # the pool is back to the context alone after every measurement
  assert data["live_kv"]["live_tokens"] == 32 and data["live_kv"]["reserved_slots"] == 0


def test_engine_step_bench_key_window_curve(tmp_path):
  out = _load_bench().main([f"--out={tmp_path}", "--smoke", "--T=1", "--repeats=2",
                            "--num_pages=40", "--window_T=4"])
  kw = out["key_window"]
  assert kw["T"] == 4 and kw["slots"] == 640 and kw["visible_slots"] == [256, 512, 640]
  assert set(kw["ms"]) == {"256", "512", "640"}
  assert all(math.isfinite(v) and v > 0 for v in kw["ms"].values())
  assert kw["key_window"] == {"256": 256, "512": 512, "640": 640}   # each step its own window
  assert kw["relative_to_whole_pool"]["640"] == 1.0
