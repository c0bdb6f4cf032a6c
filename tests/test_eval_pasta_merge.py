"""Sharded PASTA evals merged (selforch_jax.eval.pasta_merge) report what one run over the union
reports: the same outputs and every figure recomputed from the union's records."""

import json
import math

import numpy as np
import pytest

from selforch_jax.eval import pasta as eval_pasta
from selforch_jax.eval.pasta_merge import main, merge


def _config(offset, n, pareto=""):
  c = eval_pasta.defaults()
  c.model.preset = "tiny_smollm2"
  c.model.weights = "random"
  c.model.tokenizer = "smollm2_gguf"
  c.model.tags = True
  c.systems = "ar,pasta,apar"
  c.n, c.offset, c.max_new_tokens = n, offset, 6
  c.apar.child_tokens = 4
  c.n_boot = 200
  c.warmup = False
  c.pareto = pareto
  return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_tagged_model_dir):
  root = tmp_path_factory.mktemp("pasta_shards")
  dirs = {k: str(root / k) for k in ("full", "a", "b")}
  pareto = f"lam1/r1={tiny_tagged_model_dir}"   # another model: one pareto run, its own outputs
  eval_pasta.run(_config(0, 3, pareto), dirs["full"])
  eval_pasta.run(_config(0, 1, pareto), dirs["a"])
  eval_pasta.run(_config(1, 2, pareto), dirs["b"])
  return dirs


def _recs(d):
  return [json.loads(l) for l in open(f"{d}/pasta_eval_records.jsonl")]


def test_merged_shards_equal_one_run_over_the_union(runs, tmp_path):
  full = json.load(open(f"{runs['full']}/pasta_eval.json"))
  got = merge([runs["b"], runs["a"]], str(tmp_path))   # any order
  assert got["n"] == 3 and got["subset"] == [0, 3]
  assert got["config"]["offset"] == 0 and got["config"]["n"] == 3
  assert got["shards"] == [runs["a"], runs["b"]]
  want, have = _recs(runs["full"]), _recs(tmp_path)
  key = lambda r: (r["system"], r["prompt_index"])  # noqa: E731
  assert sorted(map(key, have)) == sorted(map(key, want))
  w = {key(r): r for r in want}
  for r in have:
    assert r["text"] == w[key(r)]["text"], key(r)
  assert list(got["systems"]) == ["ar", "pasta", "apar", "pasta[lam1/r1]"]
  assert [r["text"] for r in have if r["system"] == "pasta[lam1/r1]"] != [
      r["text"] for r in have if r["system"] == "pasta"]
  for s in ("ar", "pasta", "apar", "pasta[lam1/r1]"):
    for k in ("theoretical_speedup", "tokens_per_forward", "parse_rate", "parse_rate_strict",
              "nll", "nll_minus_ar", "length"):
      assert got["systems"][s][k]["n"] == 3
      assert got["systems"][s][k]["mean"] == pytest.approx(full["systems"][s][k]["mean"],
                                                           abs=1e-5), (s, k)
    # wall clock differs between runs: the merged figure is the union's geometric mean
    ratios = [a["wall_s"] / r["wall_s"] for a, r in zip(
        sorted((r for r in have if r["system"] == "ar"), key=key),
        sorted((r for r in have if r["system"] == s), key=key))]
    assert got["systems"][s]["wall_speedup"]["mean"] == pytest.approx(
        math.exp(np.mean(np.log(ratios))))
  assert got["total_wall_s"] == pytest.approx(sum(got["shard_wall_s"]))
  assert (tmp_path / "pasta_pareto.png").read_bytes()[:4] == b"\x89PNG"
  assert json.load(open(tmp_path / "pasta_eval.json"))["systems"].keys() == full["systems"].keys()


def test_merge_refuses_overlaps_other_configs_judges_and_stale_records(runs, tmp_path):
  with pytest.raises(ValueError, match=r"\[1, 3\] \(.*\) overlap: shards must cover"):
    merge([runs["full"], runs["b"]], str(tmp_path / "x"))
  with pytest.raises(ValueError, match="one of the shards"):
    merge([runs["a"], runs["b"]], runs["a"])
  with pytest.raises(FileNotFoundError, match="pasta_eval.json"):
    merge([runs["a"], str(tmp_path)], str(tmp_path / "x"))

  def variant(name, edit, records=None):
    rep = json.load(open(f"{runs['b']}/pasta_eval.json"))
    edit(rep)
    (tmp_path / name).mkdir()
    json.dump(rep, open(tmp_path / name / "pasta_eval.json", "w"))
    lines = open(f"{runs['b']}/pasta_eval_records.jsonl").read().splitlines()
    (tmp_path / name / "pasta_eval_records.jsonl").write_text(
        "\n".join(records(lines) if records else lines) + "\n")
    return str(tmp_path / name)

  other = variant("c", lambda r: r["config"].update(max_new_tokens=99))
  with pytest.raises(ValueError, match="config differs .*offset/n: max_new_tokens$"):
    merge([runs["a"], other], str(tmp_path / "x"))
  forced = variant("f", lambda r: r["config"]["forced"].update(n=1))
  a_forced = variant("af", lambda r: r["config"]["forced"].update(n=1))
  with pytest.raises(ValueError, match="forced-plan"):
    merge([forced, a_forced], str(tmp_path / "x"))
  renamed = variant("r", lambda r: None, records=lambda lines: [
      l.replace('"system": "pasta[lam1/r1]"', '"system": "lam1/r1"') for l in lines])
  with pytest.raises(ValueError, match="no records of system 'pasta\\[lam1/r1\\]'"):
    merge([runs["a"], renamed], str(tmp_path / "x"))
  judged = variant("j", lambda r: r["config"]["judge"].update(backend="local"))
  a_judged = variant("aj", lambda r: r["config"]["judge"].update(backend="local"))
  with pytest.raises(ValueError, match="judge"):
    merge([judged, a_judged], str(tmp_path / "x"))
  gap = variant("g", lambda r: r.update(subset=[2, 3]))
  with pytest.raises(ValueError, match=r"\[0, 1\] \(.*\) and \[2, 3\] \(.*\) leave a gap"):
    merge([runs["a"], gap], str(tmp_path / "x"))
  with pytest.raises(ValueError, match="overlap \\(one directory given twice\\)"):
    merge([runs["a"], runs["a"]], str(tmp_path / "x"))
  stale = variant("s", lambda r: None, records=lambda lines: lines[:-1])
  with pytest.raises(ValueError, match="stale or foreign"):
    merge([runs["a"], stale], str(tmp_path / "x"))
  with pytest.raises(SystemExit, match="error: .*overlap"):
    main(["--out", str(tmp_path / "y"), runs["a"], runs["full"]])
