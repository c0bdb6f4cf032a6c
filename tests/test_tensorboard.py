"""Training metrics land in TensorBoard event files under namespaced tags (train/..., eval/...)."""

import glob
import json
import os
import struct

import pytest

pytest.importorskip("tensorboardX")
from tensorboardX.proto import event_pb2  # noqa: E402

from selforch_jax.trainers.run import MetricsWriter, tb_tag  # noqa: E402


def read_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
  """``{tag: [(step, value), ...]}`` of every event file in ``directory`` (TFRecord framing:
  uint64 length, uint32 crc, payload, uint32 crc)."""
  out: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      for v in ev.summary.value:
        out.setdefault(v.tag, []).append((ev.step, v.simple_value))
  return out


def test_tb_tag():
  assert tb_tag("loss") == "train/loss"
  assert tb_tag("lr") == "train/lr"
  assert tb_tag("eval_loss") == "eval/loss"
  assert tb_tag("eval_accuracy") == "eval/accuracy"
  assert tb_tag("rollout/reward") == "rollout/reward"


def test_metrics_writer_event_file_has_namespaced_tags(tmp_path):
  w = MetricsWriter(str(tmp_path))
  w.write(1, {"loss": 2.5, "lr": 1e-3, "note": "text is not a scalar"})
  w.write(2, {"loss": 2.0, "lr": 5e-4})
  w.write(2, {"eval_loss": 1.75, "eval_ppl": 5.75})
  w.close()
  scalars = read_scalars(str(tmp_path / "tb"))
  assert set(scalars) == {"train/loss", "train/lr", "eval/loss", "eval/ppl"}
  assert scalars["train/loss"] == [(1, 2.5), (2, 2.0)]
  assert scalars["eval/loss"] == [(2, 1.75)]
  assert scalars["train/lr"][0][1] == pytest.approx(1e-3)
  # metrics.jsonl keeps the original keys
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert rows[0] == {"step": 1, "loss": 2.5, "lr": 1e-3, "note": "text is not a scalar"}
  assert rows[2] == {"step": 2, "eval_loss": 1.75, "eval_ppl": 5.75}


def test_metrics_writer_without_tensorboardx(tmp_path, monkeypatch):
  import builtins

  real_import = builtins.__import__

  def no_tbx(name, *args, **kwargs):
    if name == "tensorboardX":
      raise ImportError("no tensorboardX")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_tbx)
  w = MetricsWriter(str(tmp_path))
  w.write(1, {"loss": 1.0})
  w.close()
  assert w.tb is None and not (tmp_path / "tb").exists()
  assert json.loads(open(tmp_path / "metrics.jsonl").read()) == {"step": 1, "loss": 1.0}
