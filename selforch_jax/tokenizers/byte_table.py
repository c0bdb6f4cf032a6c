"""GPT-2's reversible byte -> printable character table (byte-level BPE vocabularies), shared
by the GGUF builder and the HF tokenizer's byte decoding."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable unicode character table."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))
