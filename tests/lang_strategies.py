"""Hypothesis helpers shared by the language tests."""

from hypothesis import strategies as st


def mutate(draw, ids: list[int], alphabet: list[int], max_ops: int = 3) -> list[int]:
  """Apply 0..max_ops random insertions / deletions / substitutions of ``alphabet`` tokens."""
  ids = list(ids)
  for _ in range(draw(st.integers(0, max_ops))):
    op = draw(st.sampled_from(["ins", "del", "sub"]))
    if op == "ins" or not ids:
      ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from(alphabet)))
    elif op == "del":
      del ids[draw(st.integers(0, len(ids) - 1))]
    else:
      ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from(alphabet))
  return ids
