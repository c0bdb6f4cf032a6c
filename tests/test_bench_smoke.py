"""Smoke test of bench/decode_throughput.py on a tiny random model (no torch, no llama.cpp)."""

from __future__ import annotations

import json
import math

from tests.repo_files import load_module


def _load_bench():
  return load_module("bench/decode_throughput.py")


def _positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_decode_throughput_smoke(tmp_path):
  bench = _load_bench()
  out = bench.main([f"--out={tmp_path}", "--model=tiny_llama", "--new_tokens=4", "--prompts=1",
                    "--repeats=1", "--dtypes=float32,bfloat16", "--skip_torch", "--skip_llamacpp",
                    "--bandwidth_mb=8", "--forward_T=1,2", "--forward_cache_len=32",
                    "--forward_repeats=2"])
  path = tmp_path / "decode_throughput.json"
  assert path.exists()
  data = json.loads(path.read_text())
  assert data == json.loads(json.dumps(out))

  for key in ("config", "machine", "ours", "forward_cost", "transformers", "llamacpp",
              "agreement", "roofline", "ratios", "targets", "wall_s"):
    assert key in data, key
  assert data["machine"]["cpu_count"] >= 1 and data["machine"]["jax"]
  assert data["transformers"]["status"].startswith("skipped")
  assert data["llamacpp"]["status"].startswith("skipped")

  for dtype in ("float32", "bfloat16"):
    o = data["ours"][dtype]
    for f in ("decode_tokens_per_s", "prefill_ms", "end_to_end_tokens_per_s", "param_bytes"):
      assert _positive(o[f]), (dtype, f, o[f])
    r = data["roofline"][dtype]
    assert _positive(r["weight_bytes_per_token"]) and _positive(r["roofline_tokens_per_s"])
    assert _positive(r["ours_fraction_of_roofline"])
    assert _positive(data["ratios"][dtype]["ours_over_roofline"])
  # bf16 parameters are half the bytes of float32 ones
  assert data["ours"]["bfloat16"]["param_bytes"] * 2 == data["ours"]["float32"]["param_bytes"]
  assert _positive(data["roofline"]["copy_gb_per_s_used"])

  fc = data["forward_cost"]
  assert set(fc["ms"]) == {"1", "2"}
  assert all(_positive(v) for v in fc["ms"].values())
  assert fc["relative_to_T1"]["1"] == 1.0
  assert isinstance(data["targets"]["float32_ours_ge_75pct_roofline"], bool)
