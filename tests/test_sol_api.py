"""SOL through the API and the decode CLI's config (issue 22): a policy adapter round trip, rows
carrying ``target_budget`` / ``achieved_budget``, the ``sol.budget`` and ``sol.budget_guard``
options, one-line errors."""

import json

import numpy as np
import pytest
from flax import nnx

from selforch_jax import api
from selforch_jax.decoding import run as decode_run
from selforch_jax.models.sol_policy import SolPolicyConfig, init_policy
from selforch_jax.runtime.sol_actions import ActionGrid
from selforch_jax.sol_adapter import export_sol_adapter, load_sol_policy
from tests.trace_fixtures import tiny  # noqa: F401

GRID = ActionGrid.named("cpu")


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
  model, _ = tiny
  pol = init_policy(SolPolicyConfig(lm_dim=model.cfg.hidden_size, num_actions=27, d_model=32,
                                    max_len=64), seed=3)
  out = str(tmp_path_factory.mktemp("sol") / "sol_tiny")
  export_sol_adapter(pol, GRID, "quest(8)", {"preset": "tiny_llama"}, out,
                     metrics={"budget_error": 0.1})
  return pol, out


def test_adapter_round_trip(adapter):
  pol, path = adapter
  got, grid, sparsity, meta = load_sol_policy(path)
  assert grid == GRID and sparsity == "quest(8)" and meta["kind"] == "sol"
  a = nnx.to_pure_dict(nnx.state(pol, nnx.Param))
  b = nnx.to_pure_dict(nnx.state(got, nnx.Param))
  for x, y in zip(nnx.to_flat_state(nnx.state(pol)), nnx.to_flat_state(nnx.state(got))):
    np.testing.assert_array_equal(np.asarray(x[1].get_value()), np.asarray(y[1].get_value()))
  assert a.keys() == b.keys()
  with open(f"{path}/adapter_config.json") as f:
    assert json.load(f)["grid"]["bits"] == [6, 8, 16]


def test_decode_rows_carry_target_and_achieved_budget(tiny, adapter):
  model, tok = tiny
  _, path = adapter
  p = tok.encode_chat([{"role": "user", "content": "Name three colors and why."}])
  a, b = api.decode_ids(model, tok, [p, p[:-3]], runtime="sol", max_new_tokens=10,
                        options={"policy": path, "budget": "0.5,0.8,8"})
  for ans in (a, b):
    f = ans.figures
    assert f["target_budget"] == [0.5, 0.8, 8.0]
    assert len(f["achieved_budget"]) == 3 and 0 < f["achieved_budget"][0] <= 1
    assert 0.6 <= f["achieved_budget"][1] <= 1 and 6 <= f["achieved_budget"][2] <= 16
    # the first token comes from the dense prefill; every later one from a controlled step
    assert f["controlled_steps"] == len(ans.token_ids) + int(ans.finish_reason == "stop") - 1
    assert f["budget_guard"] == 0.02               # the guard is on by default at decode
  off, = api.decode_ids(model, tok, [p], runtime="sol", max_new_tokens=4,
                        options={"policy": path, "budget_guard": 0})
  assert off.figures["budget_guard"] is None
  with pytest.raises(api.ApiError, match="budget_guard"):
    api.decode_ids(model, tok, [p], runtime="sol", max_new_tokens=4,
                   options={"policy": path, "budget_guard": -1})
  with pytest.raises(api.ApiError, match="SOL budget"):
    api.decode_ids(model, tok, [p], runtime="sol", max_new_tokens=4,
                   options={"policy": path, "budget": "0.5,8"})
  with pytest.raises(api.ApiError, match="needs options"):
    api.decode_ids(model, tok, [p], runtime="sol", max_new_tokens=4)


def test_decode_config_option_and_adapter_checks(adapter, tmp_path):
  _, path = adapter
  c = decode_run.defaults()
  c.runtime, c.adapter, c.model.preset = "sol", path, "tiny_llama"
  c.sol.budget = "0.25,0.6,6"
  assert decode_run.options(c) == {"budget": "0.25,0.6,6", "budget_guard": 0.02, "policy": path}
  c.sol.budget = "0.25,0.6"
  with pytest.raises(Exception, match="sol.budget"):
    decode_run.validate(c)
  with pytest.raises(api.ApiError, match="needs a SOL policy adapter"):
    api.resolve_adapter("sol", None, "tiny_llama")
  (tmp_path / "adapter_config.json").write_text(json.dumps({"model": {"preset": "tiny_llama"}}))
  with pytest.raises(api.ApiError, match="not a SOL policy adapter"):
    api.check_adapter(str(tmp_path), "tiny_llama", "sol")


def test_the_committed_smollm2_policy_loads():
  import os
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "adapters", "sol_smollm2_135m")
  pol, grid, sparsity, meta = load_sol_policy(path)
  assert meta["model"]["preset"] == "smollm2_135m" and pol.cfg.lm_dim == 576
  assert grid == GRID and pol.cfg.num_actions == 27 and sparsity == "quest(8)"
  assert api.check_adapter(path, "smollm2_135m", "sol")["preset"] == "smollm2_135m"
