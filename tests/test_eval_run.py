"""The eval app end to end on a toy-width model: base vs 'fine-tuned' in one run, with CIs."""

import json

import numpy as np

from selforch_jax import config_lib
from selforch_jax.checkpoints.safetensors_io import export_hf
from selforch_jax.eval.run import defaults, run


def test_eval_run_base_and_finetuned(tmp_path):
  c = defaults()
  c.model.preset = "tiny_smollm2"
  c.model.weights = "random"
  c.model.tokenizer = "smollm2_gguf"
  c.eval.n = 4
  c.eval.offset = 2
  c.eval.max_new_tokens = 6
  c.eval.batch_size = 4
  c.eval.n_boot = 500
  # the "fine-tuned" model: another random init exported as an HF dir with the tokenizer
  mc = c.model.copy_and_resolve_references()
  mc.seed = 1
  cfg, model, tok = config_lib.load_model(mc)
  export_hf(model, cfg, str(tmp_path / "ft"), tokenizer=tok)
  c.finetuned = str(tmp_path / "ft")
  out = run(c, str(tmp_path / "ev"))
  assert out["n"] == 4 and out["subset"] == [2, 6]
  for name in ("base", "finetuned"):
    acc = out["models"][name]["accuracy"]
    assert acc["n"] == 4 and 0.0 <= acc["lo"] <= acc["mean"] <= acc["hi"] <= 1.0
    rows = [json.loads(l) for l in open(tmp_path / "ev" / f"answers_{name}.jsonl")]
    assert len(rows) == 4
    assert acc["mean"] == np.mean([r["correct"] for r in rows])
  assert rows[0]["question"].startswith("Josh decides to try flipping a house")  # row 2 of test.jsonl
  assert out["finetuned_minus_base"]["n"] == 4
  saved = json.load(open(tmp_path / "ev" / "eval_results.json"))
  assert saved["models"]["finetuned"]["source"] == str(tmp_path / "ft")
  assert saved["models"]["base"]["model_config"]["hidden_size"] == 64
  assert saved["models"]["base"]["accuracy_str"].endswith("(n=4)")
