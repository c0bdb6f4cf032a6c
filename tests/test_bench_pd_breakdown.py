"""bench/planned_diffusion_breakdown.py: error categories and the by-k table of a cities JSON."""

from __future__ import annotations

import json

import pytest

from selforch_jax.data.synthetic_cities import city_sentence, generate_split
from tests.repo_files import load_module


def _module():
  return load_module("bench/planned_diffusion_breakdown.py")


def test_categories_and_table(tmp_path, capsys):
  mod = _module()
  exs = generate_split(2, 1000)
  a, b = exs[0]["cities"][0], exs[0]["cities"][1]
  # example 0: city a right, city b with its population's trailing zeros dropped, the rest absent
  wrong_b = city_sentence(b).replace(f"{b['pop']} people", f"{b['pop'] // 100} people")
  text0 = city_sentence(a) + " " + wrong_b
  # example 1: first city's country and year wrong, every other city right
  c1 = dict(exs[1]["cities"][0], country="Zzz", year=1)
  text1 = " ".join([city_sentence(c1)] + [city_sentence(c) for c in exs[1]["cities"][1:]])
  got = mod.categories([{"text": text0}, {"text": text1}], exs)
  assert got == {"missing": len(exs[0]["cities"]) - 2, "pop_only": 1, "pop_dropped_zeros": 1,
                 "one_other": 0, "several": 1}
  # a one-field error that is not the population
  c2 = dict(a, river="Qqq")
  assert mod.categories([{"text": city_sentence(c2)}], [{"cities": [a]}])["one_other"] == 1
  # the name in a sentence not of the fixed form: several, not missing
  malformed = f"{a['name']} is a city in {a['country']}, river {a['river']}."
  assert mod.categories([{"text": malformed}], [{"cities": [a]}])["several"] == 1
  # written twice, both wrong: the first sentence is judged (population alone here)
  twice = (city_sentence(dict(a, pop=a["pop"] + 1)) + " "
           + city_sentence(dict(a, country="Zzz", year=1)))
  got = mod.categories([{"text": twice}], [{"cities": [a]}])
  assert got["pop_only"] == 1 and got["several"] == 0

  def rec(ex, text, cp, wall):
    hits = [city_sentence(c) in text for c in ex["cities"]]
    return {"k": len(ex["cities"]), "text": text, "items": len(hits), "items_correct": sum(hits),
            "critical_path": cp, "wall_s": wall}
  full = [" ".join(city_sentence(c) for c in e["cities"]) for e in exs]
  d = {"task": "cities", "args": {"seed": 1000},
       "records": {"pd": [rec(exs[0], text0, 50, 4.0), rec(exs[1], text1, 60, 4.0)],
                   "ar": [rec(exs[0], full[0], 100, 1.0), rec(exs[1], full[1], 100, 1.0)]}}
  path = tmp_path / "run.json"
  path.write_text(json.dumps(d))
  mod.main(str(path))
  out = capsys.readouterr().out
  assert "n = 2 answers" in out and "0.25x |" in out
  assert "ar {'missing': 0, 'pop_only': 0" in out


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
  mod = _module()
  bad = tmp_path / "x.json"
  bad.write_text("not json")
  with pytest.raises(SystemExit) as e:
    mod.main(str(bad))
  assert e.value.code == 2 and "cannot read" in capsys.readouterr().err
  bad.write_text(json.dumps({"task": "alpaca", "records": {}}))
  with pytest.raises(SystemExit) as e:
    mod.main(str(bad))
  assert e.value.code == 2 and "not a bench/planned_diffusion.py cities run" in capsys.readouterr().err
  good = {"task": "cities", "args": {"seed": 1000},
          "records": {"pd": [{"k": 2, "items": 2}], "ar": [{"k": 2, "items": 2}]}}
  bad.write_text(json.dumps(good))            # records without their fields
  with pytest.raises(SystemExit) as e:
    mod.main(str(bad))
  cap = capsys.readouterr()
  assert e.value.code == 2 and "KeyError" in cap.err and cap.out == ""
