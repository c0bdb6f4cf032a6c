"""Smoke test of bench/planned_diffusion.py (issue 21) on tiny random SmolLM2-vocabulary adapters:
both tasks (cities exact match, AlpacaEval NLL under the base model), all four systems (PD,
AR-SFT, PASTA, Dream-style), the JSON's figures and the Pareto PNG."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.repo_files import load_module

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _usage_error(capsys, fn, *args) -> str:
  """Run ``fn(*args)``, which must fail as argparse does (exit 2); its stderr's last line."""
  with pytest.raises(SystemExit) as e:
    fn(*args)
  assert e.value.code == 2
  return capsys.readouterr().err.strip().splitlines()[-1]


def _load_bench():
  return load_module("bench/planned_diffusion.py")


def _tiny_adapter(out_dir: str) -> str:
  """An adapter of the tiny random SmolLM2 (tags, LoRA rank 2) in the committed format."""
  from selforch_jax import adapter, config_lib
  from selforch_jax.models.transformer import add_lora
  from selforch_jax.trainers.run import defaults
  mc = defaults().model
  mc.preset, mc.weights, mc.tokenizer, mc.tags = "tiny_smollm2", "random", "smollm2_gguf", True
  mc.lora_rank, mc.lora_alpha = 2, 4.0
  _, base, tok = config_lib.load_model(mc)
  model = add_lora(base, mc.lora_rank, mc.lora_alpha, mc.lora_targets)
  rows_from = 49152
  vocab = int(model.cfg.vocab_size)
  tensors = adapter._lora_tensors(model) | adapter._row_tensors(model, rows_from)
  meta = {"format": "selforch_jax.adapter/1", "model": mc.to_dict(), "rows_from": rows_from,
          "vocab_size": vocab, "added_tokens": adapter._added_tokens(tok, mc, rows_from, vocab),
          "tensors": {k: list(v.shape) for k, v in sorted(tensors.items())}}
  return adapter.write_adapter_files(out_dir, tensors, meta)


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory):
  return _tiny_adapter(str(tmp_path_factory.mktemp("pd_bench") / "adapter"))


@pytest.mark.parametrize("task", ["cities", "alpaca"])
def test_bench_smoke(tmp_path, tiny_adapter, task):
  bench = _load_bench()
  out_json = tmp_path / "pd.json"
  out = bench.main([f"--task={task}", f"--pd_adapter={tiny_adapter}",
                    f"--ar_adapter={tiny_adapter}", f"--pasta_adapter={tiny_adapter}",
                    "--dream=12", "--n=2", "--warmup=1", "--max_new_tokens=20",
                    "--n_boot=200", "--prompt_tokens=400", f"--out={out_json}"])
  data = json.loads(out_json.read_text())
  assert data["n_done"] == 2 and set(data["systems"]) == {"pd", "ar", "pasta", "dream"}
  quality = "item_accuracy" if task == "cities" else "length"
  for s, summ in data["systems"].items():
    assert summ["n_answers"] == 2 and summ[quality]["n"] >= 1, s
    assert summ["wall_s"]["mean"] > 0 and summ["critical_path"]["mean"] >= 0
  assert data["systems"]["ar"]["well_formed"]["mean"] == 1.0
  for s in ("pd", "pasta", "dream"):
    vs = data["vs_ar"][s]
    assert vs["speedup"]["mean"] > 0 and vs["critical_path_ratio"]["n"] == 2
    assert ("item_fraction_diff" if task == "cities" else "nll_diff") in vs
  # Dream: the whole answer one chunk of 12 masks, 0.5 x 12 denoising steps, no AR step
  for r in data["records"]["dream"]:
    assert r["critical_path"] == 6 and r["ar_steps"] == 0 and r["tokens"] == 14
  if task == "alpaca":
    ar = data["records"]["ar"]
    assert all(r["nll"] is None or r["nll"] > 0 for r in ar)
  assert (tmp_path / "pd.png").stat().st_size > 1000
  assert out["command"].startswith("python bench/planned_diffusion.py")


def test_bench_threshold_and_ar_from(tmp_path, tiny_adapter, capsys):
  """--threshold (Fast-dLLM unmasking) reaches the PD scheduler's options and the JSON (out of
  range is an error); --ar_from reuses an earlier run's AR records (other examples: an error)."""
  import argparse

  from selforch_jax.adapter import load_adapter
  bench = _load_bench()
  args = argparse.Namespace(max_new_tokens=20, steps_ratio=0.5, confidence="entropy",
                            threshold=0.9, dream=0, pad_last=True, spread=True, window=3,
                            pad_tail=True, seed_topic=True)
  kw = bench.System("pd", load_adapter(tiny_adapter), 400, args).kw
  assert kw["threshold"] == 0.9 and kw["pad_last"] is True and kw["spread"] is True
  assert kw["window"] == 3 and kw["pad_tail"] is True and kw["seed_topic"] is True
  args.threshold = 0.0
  assert bench.System("pd", load_adapter(tiny_adapter), 400, args).kw["threshold"] is None
  common = ["--task=cities", f"--pd_adapter={tiny_adapter}", "--warmup=0",
            "--max_new_tokens=20", "--n_boot=50", "--prompt_tokens=400"]
  first = bench.main(common + [f"--ar_adapter={tiny_adapter}", "--n=2",
                               f"--out={tmp_path / 'first.json'}"])
  # --ar_from: the AR records of that run, paired by example; PD decoded with the threshold;
  # a larger --n stops where the earlier run's records end
  out = bench.main(common + ["--n=3", "--threshold=0.9", f"--ar_from={tmp_path / 'first.json'}",
                             f"--out={tmp_path / 'thr.json'}"])
  assert out["args"]["threshold"] == 0.9 and out["n_done"] == 2
  assert out["records"]["ar"] == first["records"]["ar"]
  assert out["ar_from"]["path"] == str(tmp_path / "first.json")
  assert out["vs_ar"]["pd"]["critical_path_ratio"]["n"] == 2
  assert out["systems"]["ar"] == first["systems"]["ar"]
  with pytest.raises(SystemExit):
    bench.main(["--threshold=1.5", f"--pd_adapter={tiny_adapter}", "--n=1"])
  assert "seed=1000 there, 7 here" in _usage_error(    # other examples
      capsys, bench.main, common + ["--n=1", "--seed=7", f"--ar_from={tmp_path / 'first.json'}",
                                    f"--out={tmp_path / 'bad.json'}"])


def test_pareto_of_variants(tmp_path, capsys):
  """bench/planned_diffusion_pareto.py on two committed cities runs (same seed): one PNG, each
  run's figures as recorded, and the common-prefix figures recomputed from the records."""
  mod = load_module("bench/planned_diffusion_pareto.py")
  res = os.path.join(REPO_ROOT, "bench", "results")
  paths = [os.path.join(res, f"planned_diffusion_cities_{v}_cpu.json")
           for v in ("pd150", "pd235_padlast")]
  mod.main(paths + [f"--out={tmp_path / 'p.png'}"])
  assert (tmp_path / "p.png").stat().st_size > 1000
  runs = mod.load_runs(paths)
  rows = mod.common_prefix(runs)
  m = min(d["n_done"] for d in runs)
  assert [r["n"] for r in rows] == [m, m] and rows[1]["label"] == "ratio 0.5, pad_last"
  recs = runs[1]["records"]["pd"]          # the shorter run: its prefix is all of it
  assert len(recs) == m
  assert rows[1]["item_accuracy"] == pytest.approx(
      runs[1]["systems"]["pd"]["item_accuracy"]["mean"])
  assert rows[1]["cp_ratio"] == pytest.approx(
      runs[1]["vs_ar"]["pd"]["critical_path_ratio"]["mean"])
  assert "item_acc 0.434" in capsys.readouterr().out
  bad = dict(runs[0], args=dict(runs[0]["args"], seed=7))
  (tmp_path / "bad.json").write_text(json.dumps(bad))
  with pytest.raises(ValueError, match="seed"):
    mod.load_runs([paths[1], str(tmp_path / "bad.json")])

def test_bench_without_pd(tmp_path, tiny_adapter):
  """--pd_adapter='' runs PASTA vs AR alone (alpaca: the NLL's base weights come from the first
  adapter given); --dream without the PD adapter is an error."""
  bench = _load_bench()
  out = bench.main(["--task=alpaca", "--pd_adapter=", f"--ar_adapter={tiny_adapter}",
                    f"--pasta_adapter={tiny_adapter}", "--n=2", "--warmup=0",
                    "--max_new_tokens=12", "--n_boot=50", "--prompt_tokens=400",
                    f"--out={tmp_path / 'nopd.json'}"])
  assert set(out["systems"]) == {"ar", "pasta"} and out["n_done"] == 2
  assert set(out["vs_ar"]) == {"pasta"} and out["vs_ar"]["pasta"]["critical_path_ratio"]["n"] == 2
  assert all(r["nll"] is None or r["nll"] > 0 for r in out["records"]["pasta"])
  with pytest.raises(SystemExit):
    bench.main(["--pd_adapter=", "--dream=8", f"--ar_adapter={tiny_adapter}", "--n=1"])


def test_bench_resume(tmp_path, tiny_adapter, monkeypatch, capsys):
  """A run killed mid-way keeps the examples it finished in its JSON; --resume keeps them and
  decodes the examples after them: the records equal one uninterrupted run's (greedy),
  ``segments`` gives each run's example range, and a resumed run with other options or systems
  is an error."""
  bench = _load_bench()
  common = ["--task=cities", f"--pd_adapter={tiny_adapter}", f"--ar_adapter={tiny_adapter}",
            "--warmup=0", "--max_new_tokens=16", "--n_boot=50", "--prompt_tokens=400"]
  path = tmp_path / "resumed.json"
  decode, calls = bench.System.decode, []

  def killed_on_the_second_ar(self, prompt):
    calls.append(self.name)
    if calls.count("ar") == 2:
      raise KeyboardInterrupt
    return decode(self, prompt)

  monkeypatch.setattr(bench.System, "decode", killed_on_the_second_ar)
  with pytest.raises(KeyboardInterrupt):                  # no file yet: a fresh run
    bench.main(common + ["--n=3", "--resume", f"--out={path}"])
  monkeypatch.setattr(bench.System, "decode", decode)
  first = json.loads(path.read_text())
  assert first["n_done"] == 1 and [g["examples"] for g in first["segments"]] == [[0, 1]]
  assert not os.path.exists(str(path) + ".tmp")
  out = bench.main(common + ["--n=3", "--resume", f"--out={path}"])
  assert out["n_done"] == 3 and [g["examples"] for g in out["segments"]] == [[0, 1], [1, 3]]
  assert out["records"]["pd"][0] == first["records"]["pd"][0]
  whole = bench.main(common + ["--n=3", f"--out={tmp_path / 'whole.json'}"])
  keys = ("k", "items", "text", "critical_path", "items_correct", "n_ids")
  for s in ("pd", "ar"):
    assert ([[r[k] for k in keys] for r in out["records"][s]]
            == [[r[k] for k in keys] for r in whole["records"][s]]), s
    assert out["systems"][s]["item_accuracy"] == whole["systems"][s]["item_accuracy"]
  assert out["elapsed_s"] == pytest.approx(sum(g["elapsed_s"] for g in out["segments"]))
  before = path.read_text()
  again = bench.main(common + ["--n=3", "--resume", f"--out={path}"])   # nothing left to do
  assert again["records"] == out["records"] and path.read_text() == before
  err = lambda extra: _usage_error(capsys, bench.main, extra + [f"--out={path}"])  # noqa: E731
  assert "threshold=0.0 there, 0.9 here" in err(common + ["--n=4", "--resume", "--threshold=0.9"])
  assert "systems ['ar', 'pd'] there, ['pd'] here" in err(common[:2] + common[3:]
                                                          + ["--n=4", "--resume"])
  assert "3 examples > --n=2" in err(common + ["--n=2", "--resume"])   # --n grows, not shrinks
  (tmp_path / "broken.json").write_text("{ not json")
  assert "--resume" in _usage_error(capsys, bench.main, common + [
      "--n=4", "--resume", f"--out={tmp_path / 'broken.json'}"])
  # the AR records' adapter: the same path through --ar_from passes, another one does not
  assert bench.main(common[:2] + common[3:] + [
      "--n=4", "--resume", f"--ar_from={tmp_path / 'whole.json'}", f"--out={path}"])["n_done"] == 3
  other = shutil.copytree(tiny_adapter, tmp_path / "other_ar")   # same weights, another path
  assert "AR records are of the adapter" in err(common[:2] + [f"--ar_adapter={other}"]
                                                 + common[3:] + ["--n=4", "--resume"])
