"""Sharded TIP evals merged (selforch_jax.eval.tip_merge) report what one run over the union
reports: same outputs, accuracy, live KV, reductions and teacher-forced figures."""

import json

import pytest

from selforch_jax.eval.tip import defaults, run
from selforch_jax.eval.tip_merge import main, merge


def _config(offset, n):
  c = defaults()
  c.model.preset = "tiny_smollm2"
  c.model.weights = "random"
  c.model.tokenizer = "smollm2_gguf"
  c.eval.datasets = "synthetic_walk"
  c.eval.systems = "tip,dense,streaming_llm"
  c.eval.offset, c.eval.n = offset, n
  c.eval.max_new_tokens = 12
  c.eval.batch_size = 2
  c.eval.page_size = 8
  c.eval.n_boot = 200
  return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("shards")
  dirs = {k: str(root / k) for k in ("full", "a", "b")}
  run(_config(0, 4), dirs["full"])
  run(_config(0, 2), dirs["a"])
  run(_config(2, 2), dirs["b"])
  return dirs


def test_merged_shards_equal_one_run_over_the_union(runs, tmp_path):
  full = json.load(open(f"{runs['full']}/tip_eval.json"))["datasets"]["synthetic_walk"]
  got = merge([runs["b"], runs["a"]], str(tmp_path))["datasets"]["synthetic_walk"]  # any order
  assert got["n"] == 4 and got["subset"] == [0, 4]
  for s in ("tip", "dense", "streaming_llm"):
    want = [json.loads(l) for l in open(f"{runs['full']}/tip_synthetic_walk_{s}.jsonl")]
    have = [json.loads(l) for l in open(tmp_path / f"tip_synthetic_walk_{s}.jsonl")]
    assert [(r["question"], r["output"]) for r in have] == [(r["question"], r["output"]) for r in want]
    for k in ("accuracy", "live_kv_mean_tokens", "live_kv_peak_tokens", "prompt_mean_tokens",
              "budget_mean_tokens", "new_tokens", "live_kv_max_peak_tokens"):
      assert got["systems"][s][k] == pytest.approx(full["systems"][s][k]), (s, k)
  for k, v in full["live_kv_reduction_vs_dense"].items():
    assert got["live_kv_reduction_vs_dense"][k] == pytest.approx(v)
  assert set(got["tip_minus"]) == {"dense", "streaming_llm"}
  for k, v in full["teacher_forced"].items():
    if k != "decode_s":
      assert got["teacher_forced"][k] == pytest.approx(v), k
  assert (tmp_path / "tip_accuracy_vs_live_kv.png").read_bytes()[:4] == b"\x89PNG"


def test_merge_refuses_overlaps_other_configs_and_missing_shards(runs, tmp_path):
  with pytest.raises(ValueError, match="overlap or leave a gap"):
    merge([runs["full"], runs["b"]], str(tmp_path / "x"))
  with pytest.raises(ValueError, match="at least two"):
    merge([runs["a"]], str(tmp_path / "x"))
  with pytest.raises(FileNotFoundError, match="tip_eval.json"):
    merge([runs["a"], str(tmp_path)], str(tmp_path / "x"))
  other = json.load(open(f"{runs['b']}/tip_eval.json"))
  other["config"]["eval"]["max_new_tokens"] = 99
  (tmp_path / "c").mkdir()
  json.dump(other, open(tmp_path / "c" / "tip_eval.json", "w"))
  with pytest.raises(ValueError, match="config differs"):
    merge([runs["a"], str(tmp_path / "c")], str(tmp_path / "x"))
  with pytest.raises(SystemExit, match="error: .*overlap"):
    main(["--out", str(tmp_path / "y"), runs["a"], runs["full"]])
