"""By-k table and error categories of a ``bench/planned_diffusion.py --task=cities`` JSON.

    python bench/planned_diffusion_breakdown.py bench/results/planned_diffusion_cities_pd_default_cpu.json

Prints a Markdown table (per k = cities per prompt: answers, PD and AR item accuracy, mean
critical-path ratio PD / AR, mean wall-clock ratio AR / PD) and, per system, its wrong city
sentences by the fields that differ from the prompt's (the examples are regenerated from the
JSON's ``--seed``): ``missing`` (the city's name occurs nowhere in the answer, e.g. a
misspelt name), ``pop_only`` (of them ``pop_dropped_zeros``: the right leading digits,
trailing zeros dropped), ``one_other`` (one other field alone), ``several`` (several fields, or
the name in a sentence not of the fixed form). A city written twice is judged by its first
sentence (unless a later one is right: then it is right, as ``score_answer`` counts it).
"""
import json
import re
import sys

import numpy as np

from selforch_jax.data.synthetic_cities import city_sentence, generate_split

PAT = re.compile(r"(\S+) is a city in (\S+) on the river (\S+), founded in (\d+), with (\d+) people\.")


def categories(recs: list[dict], examples: list[dict]) -> dict[str, int]:
  """Counts of wrong city sentences by kind (see the module docstring)."""
  c = {"missing": 0, "pop_only": 0, "pop_dropped_zeros": 0, "one_other": 0, "several": 0}
  for r, ex in zip(recs, examples):
    sents: dict[str, tuple] = {}
    for m in PAT.finditer(r["text"]):
      sents.setdefault(m.group(1), m.groups())
    for city in ex["cities"]:
      if city_sentence(city) in r["text"]:
        continue
      got = sents.get(city["name"])
      if got is None:
        c["missing" if city["name"] not in r["text"] else "several"] += 1
        continue
      want = (city["name"], city["country"], city["river"], str(city["year"]), str(city["pop"]))
      diff = [j for j in range(5) if got[j] != want[j]]
      if diff == [4]:
        c["pop_only"] += 1
        tail = want[4][len(got[4]):]
        c["pop_dropped_zeros"] += int(want[4].startswith(got[4]) and set(tail) == {"0"})
      elif len(diff) == 1:
        c["one_other"] += 1
      else:
        c["several"] += 1
  return c


def fail(msg: str) -> None:
  """One-line error on stderr, exit 2."""
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


def main(path: str) -> None:
  """Print the breakdown of the JSON at ``path``; an unreadable file or one that is not a
  cities run with PD and AR records is a one-line error (exit 2)."""
  try:
    with open(path) as f:
      d = json.load(f)
  except (OSError, ValueError) as e:
    fail(f"cannot read {path} as JSON: {e}")
  recs = d.get("records") if isinstance(d, dict) else None
  if (not isinstance(recs, dict) or d.get("task") != "cities"
      or not all(isinstance(recs.get(s), list) for s in ("pd", "ar"))):
    fail(f"{path} is not a bench/planned_diffusion.py cities run with pd and ar records")
  try:
    report(d)
  except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
    fail(f"{path}: a record or field is missing or malformed ({type(e).__name__}: {e})")


def report(d: dict) -> None:
  """Print the by-k table and the error counts of a loaded cities run."""
  pd, ar = d["records"]["pd"], d["records"]["ar"]
  n = min(len(pd), len(ar))
  if not n:
    raise ValueError("no records")
  lines = []
  if len(pd) != len(ar):
    lines.append(f"note: {len(pd)} PD and {len(ar)} AR records; the first {n} (paired) are used")
  pd, ar = pd[:n], ar[:n]
  examples = generate_split(n, d["args"]["seed"])
  lines.append(f"n = {n} answers, {sum(r['items'] for r in pd)} items\n")
  lines.append("| k | answers | PD items | AR items | critical path / AR "
               "| wall-clock vs AR (mean of ratios) |")
  lines.append("|---|---|---|---|---|---|")
  for k in sorted({r["k"] for r in pd}):
    idx = [i for i in range(n) if pd[i]["k"] == k]
    acc = lambda recs: sum(recs[i]["items_correct"] for i in idx) / sum(recs[i]["items"] for i in idx)  # noqa: E731
    cp = np.mean([pd[i]["critical_path"] / ar[i]["critical_path"] for i in idx])
    sp = np.mean([ar[i]["wall_s"] / pd[i]["wall_s"] for i in idx])
    lines.append(f"| {k} | {len(idx)} | {acc(pd):.3f} | {acc(ar):.3f} | {cp:.3f} | {sp:.2f}x |")
  lines.append("\nwrong city sentences:")
  for name, recs in (("pd", pd), ("ar", ar)):
    lines.append(f"{name} {categories(recs, examples)}")
  print("\n".join(lines))


if __name__ == "__main__":
  if len(sys.argv) != 2:
    fail("usage: python bench/planned_diffusion_breakdown.py RESULTS.json")
  try:
    main(sys.argv[1])
  except BrokenPipeError:   # the output piped into `head`
    sys.stderr.close()
