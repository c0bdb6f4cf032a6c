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
  with pytest.raises(ValueError, match=r"\[2, 4\] \(.*\) overlap: shards must cover"):
    merge([runs["full"], runs["b"]], str(tmp_path / "x"))
  with pytest.raises(ValueError, match="at least two"):
    merge([runs["a"]], str(tmp_path / "x"))
  with pytest.raises(FileNotFoundError, match="tip_eval.json"):
    merge([runs["a"], str(tmp_path)], str(tmp_path / "x"))
  other = json.load(open(f"{runs['b']}/tip_eval.json"))
  other["config"]["eval"]["max_new_tokens"] = 99
  (tmp_path / "c").mkdir()
  json.dump(other, open(tmp_path / "c" / "tip_eval.json", "w"))
  with pytest.raises(ValueError, match="config differs .*: eval.max_new_tokens$"):
    merge([runs["a"], str(tmp_path / "c")], str(tmp_path / "x"))
  with pytest.raises(SystemExit, match="error: .*overlap"):
    main(["--out", str(tmp_path / "y"), runs["a"], runs["full"]])


def _fake_shard(path, lo, hi, rng, systems=("tip", "dense", "h2o"), teacher_forced=True):
  """A finished shard's files with varied correctness and live KV (no model needed)."""
  from selforch_jax.data.sources import load_examples
  from selforch_jax.eval.tip import question_texts
  path.mkdir()
  c = _config(lo, hi - lo)
  c.eval.systems = ",".join(systems)
  qs = question_texts(load_examples("synthetic_walk", split="test", max_examples=hi)[lo:], "")
  rep = {"config": c.to_dict(), "seconds": 1.0, "datasets": {"synthetic_walk": {
      "n": hi - lo, "subset": [lo, hi], "systems": {s: {"decode_s": 2.0} for s in systems}}}}
  if teacher_forced:
    from selforch_jax.eval.tip import TEACHER_FORCED_MEANS, teacher_forced_figures
    rep["datasets"]["synthetic_walk"]["teacher_forced"] = teacher_forced_figures(
        {"n": hi - lo, "decode_s": 1.0, **{k: float(rng.uniform(50, 100)) for k in
                                          TEACHER_FORCED_MEANS}})
  for s in systems:
    with open(path / f"tip_synthetic_walk_{s}.jsonl", "w") as f:
      for q in qs:
        m = float(rng.uniform(40, 200))
        f.write(json.dumps({"question": q, "correct": bool(rng.random() < 0.6), "new_tokens": 9,
                            "mean_live_tokens": m, "peak_live_tokens": int(m) + 20,
                            "mean_live_bytes": 9 * m, "peak_live_bytes": 9 * m + 9,
                            "mean_resident_tokens": m, "prompt_tokens": 40,
                            "budget": None if s in ("tip", "dense") else 60}) + "\n")
  json.dump(rep, open(path / "tip_eval.json", "w"))
  return str(path)


def test_merge_recomputes_every_figure_from_the_records(tmp_path):
  import numpy as np

  from selforch_jax.eval.tip import compare_systems, system_summary
  rng = np.random.default_rng(0)
  a = _fake_shard(tmp_path / "a", 0, 30, rng)
  b = _fake_shard(tmp_path / "b", 30, 70, rng)
  got = merge([b, a], str(tmp_path / "m"))
  assert got["config"]["eval"]["offset"] == 0 and got["config"]["eval"]["n"] == 70
  r = got["datasets"]["synthetic_walk"]
  want = {"n": 70, "systems": {}}
  correct = {}
  for s in ("tip", "dense", "h2o"):
    recs = [json.loads(l) for d in (a, b) for l in open(f"{d}/tip_synthetic_walk_{s}.jsonl")]
    want["systems"][s] = system_summary(recs, 4.0, 200, 0)
    correct[s] = np.array([x["correct"] for x in recs], float)
  compare_systems(want, correct, 200, 0)
  assert 0.3 < r["systems"]["tip"]["accuracy"]["mean"] < 0.9      # mixed flags, not all 0
  assert r["systems"] == want["systems"]
  assert r["tip_minus"] == want["tip_minus"] and r["tip_minus"]["dense"]["mean"] != 0
  assert r["live_kv_reduction_vs_dense"] == want["live_kv_reduction_vs_dense"]
  ta = json.load(open(f"{a}/tip_eval.json"))["datasets"]["synthetic_walk"]["teacher_forced"]
  tb = json.load(open(f"{b}/tip_eval.json"))["datasets"]["synthetic_walk"]["teacher_forced"]
  tip = (30 * ta["tip_live_kv_mean_tokens"] + 40 * tb["tip_live_kv_mean_tokens"]) / 70
  dense = (30 * ta["dense_live_kv_mean_tokens"] + 40 * tb["dense_live_kv_mean_tokens"]) / 70
  assert r["teacher_forced"]["reduction_mean"] == pytest.approx(1 - tip / dense)


def test_merge_refuses_foreign_records_partial_teacher_forcing_and_overwriting_a_shard(tmp_path):
  import numpy as np
  rng = np.random.default_rng(1)
  a = _fake_shard(tmp_path / "a", 0, 5, rng)
  b = _fake_shard(tmp_path / "b", 5, 9, rng)
  with pytest.raises(ValueError, match="one of the shards"):
    merge([a, b], a)
  lines = open(f"{b}/tip_synthetic_walk_dense.jsonl").readlines()
  open(f"{b}/tip_synthetic_walk_dense.jsonl", "w").writelines(lines[:-1])   # a stale file
  with pytest.raises(ValueError, match="not the test problems"):
    merge([a, b], str(tmp_path / "m"))
  assert not (tmp_path / "m").exists()                                     # nothing written
  c = _fake_shard(tmp_path / "c", 5, 9, rng, teacher_forced=False)
  with pytest.raises(ValueError, match="teacher-forced"):
    merge([a, c], str(tmp_path / "m"))
