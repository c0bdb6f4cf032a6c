"""Smoke test of bench/sft_throughput.py on a tiny random model (no torch).

seq_len is 64, not 32: every GSM8K chat (SmolLM2's system prompt + question) needs ~49+
tokens before its first answer token, so at 32 no example has a loss token.
"""

from __future__ import annotations

import json
import math

from tests.repo_files import load_module


def _load_bench():
  return load_module("bench/sft_throughput.py")


def _positive(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_sft_throughput_smoke(tmp_path):
  bench = _load_bench()
  out = bench.main([f"--out={tmp_path}", "--model=tiny_smollm2", "--skip_torch", "--steps=1",
                    "--seq_len=64", "--batch_size=2"])
  path = tmp_path / "sft_throughput.json"
  assert path.exists()
  data = json.loads(path.read_text())
  assert data == json.loads(json.dumps(out))

  for key in ("config", "machine", "batches", "ours", "torch", "agreement", "tokens_per_s",
              "step_s_median", "target", "wall_s"):
    assert key in data, key
  cfg = data["config"]
  assert (cfg["batch_size"], cfg["seq_len"], cfg["steps_timed"], cfg["warmup_steps"]) == (2, 64, 1, 1)
  assert cfg["lora_rank"] == 8 and cfg["data"]["packing"] is False
  assert "non-padding" in cfg["tokens_definition"]
  assert data["machine"]["cpu_count"] >= 1 and data["machine"]["jax"]
  assert _positive(data["machine"]["sgemm_probe_start"]["jax_gflops"])
  assert _positive(data["machine"]["sgemm_probe_end"]["jax_gflops"])
  assert data["torch"]["status"].startswith("skipped")

  o = data["ours"]
  for f in ("tokens_per_s", "all_tokens_per_s", "step_s_median", "first_step_s_incl_compile"):
    assert _positive(o[f]), (f, o[f])
  assert len(o["step_s"]) == 1 and len(o["losses"]) == 2  # warmup + timed
  assert all(_positive(x) for x in o["losses"])
  assert o["trainable_params"] > 0
  assert o["all_tokens_per_s"] >= o["tokens_per_s"]
  assert all(0 < t <= 2 * 64 for t in data["batches"]["tokens"])

  assert data["tokens_per_s"]["ours"] == o["tokens_per_s"]
  assert data["tokens_per_s"]["torch"] is None
  assert data["tokens_per_s"]["ratio_ours_over_torch"] is None
  assert _positive(data["step_s_median"]["ours"])
  assert _positive(data["agreement"]["ours_first_step_loss"])
  assert data["target"]["ratio_ge"] == 1.0 and data["target"]["met"] is None
