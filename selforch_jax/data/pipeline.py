"""The training/eval input pipeline: chat examples -> packed (or padded) numpy batches.

``make_dataset(cfg, tokenizer, split, seed)`` builds, with grain::

  ListSource(examples of the split)                     # sources.load_examples (+ held-out split)
  -> MapDataset.shuffle(seed)                           # a new permutation every epoch
  -> .repeat(num_epochs)                                # None = forever
  -> .map(tokenize_chat + shift_for_lm)                 # truncated to seq_len + 1 tokens
  -> .filter(examples with >= 1 loss token)
  -> .to_iter_dataset(ReadOptions)
  -> pack_dataset (first fit)  |  pad_dataset (one per row)
  -> .batch(batch_size, drop_remainder)

Each batch is a dict of numpy ``int32[batch_size, seq_len]`` arrays: ``tokens``,
``targets``, ``loss_mask``, ``segment_ids``, ``positions`` (see
:mod:`selforch_jax.data.packing`). The model call is
``model(batch["tokens"], batch["positions"], masks.segment_mask(batch["segment_ids"]))``
and the loss is the cross entropy of ``targets`` weighted by ``loss_mask``.

Data config schema (:class:`DataConfig`; a dict or an ``ml_collections.ConfigDict`` with
these keys is accepted, unknown keys are an error):

====================  ==========  =====================================================
field                 default     meaning
====================  ==========  =====================================================
name                  "gsm8k"     dataset: ``gsm8k``, ``alpaca``, ``alpaca_eval``, ``chat``
path                  None        training file (absolute or under ``data_dir()``);
                                  None = the dataset's default train file
split                 "train"     default split when ``make_dataset(split=None)``:
                                  ``train``, ``eval`` or a file split such as ``test``
eval_fraction         0.0         > 0: hold out this fraction of the training file;
                                  split ``eval`` is that part, ``train`` the rest
eval_split_seed       0           seed of the held-out permutation (not the shuffle seed)
eval_path             None        split ``eval`` when ``eval_fraction == 0``: this file,
                                  None = the dataset's ``test`` file
seq_len               1024        row length T (examples are cut to ``seq_len + 1``
                                  tokens before the next-token shift)
batch_size            8           rows per batch
packing               True        True: first-fit packing; False: one example per row
num_packing_bins      None        rows filled at once when packing (None = batch_size)
shuffle               True        shuffle examples (per epoch) with the seed
shuffle_seed          0           default seed when ``make_dataset(seed=None)``
num_epochs            1           passes over the split; None = repeat forever
max_examples          None        keep only the first N examples of the split
annotated_repeats     1           train split only: an example whose record has
                                  ``"annotated": true`` appears this many times per
                                  epoch (oversamples the annotated minority; the eval
                                  split is never repeated)
drop_remainder        True        drop the last incomplete batch
num_threads           4           grain read threads (tokenization runs there)
prefetch_buffer_size  64          grain read prefetch, in examples
annotated             False       rows in the orchestration language: one example per row,
                                  the mask builder's ``mask bool[B,T,T]`` and positions
                                  instead of ``segment_ids`` (:mod:`.annotated`; needs a
                                  tokenizer with the tags, ``packing=False``)
annotator             None        a registered annotator run on each example's last
                                  assistant turn (``lang.annotators``), or None
annotator_args        None        its keyword arguments (a dict)
strip_tags            False       plain responses (Baseline-SFT): no annotator, tags of
                                  pre-annotated responses removed
async_sees_full_plan  False       mask-builder option (``lang.mask.LayoutBuilder``)
chunk_bidirectional   False       mask-builder option: False, True or "auto"
====================  ==========  =====================================================

With ``annotated=True`` each batch holds ``tokens, targets, loss_mask, positions``
``int32[batch_size, seq_len]`` and ``mask bool[batch_size, seq_len, seq_len]``; the model call is
``model(batch["tokens"], batch["positions"], batch["mask"])``.

Checkpointing the iterator (exact; state is a small JSON-serialisable dict)::

  ds = make_dataset(cfg.data, tokenizer, "train", seed)
  it = iter(ds)                                   # a grain DatasetIterator
  ...
  mngr = ocp.CheckpointManager(
      workdir, item_names=("state", "data_iter"),
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "data_iter": grain.checkpoint.CheckpointHandler()})
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state),
                                          data_iter=grain.checkpoint.CheckpointSave(it)))
  # resume:
  it = iter(make_dataset(cfg.data, tokenizer, "train", seed))
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      data_iter=grain.checkpoint.CheckpointRestore(it)))   # sets its state in place
  # (tests/test_data.py::test_pipeline_orbax_checkpoint_manager runs exactly this)

The saved file is ``<step>/data_iter/process_<i>-of-<n>.json`` holding ``it.get_state()``.
Without Orbax: ``state = it.get_state()`` (a JSON-serialisable dict) ... later
``it = iter(make_dataset(same cfg, tokenizer, split, seed)); it.set_state(state)``. The
state is only valid for the same config, data files, tokenizer and seed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import grain
import numpy as np

from selforch_jax.data import packing, sources
from selforch_jax.data.tokenize import ChatTokenizer, shift_for_lm, tokenize_chat


@dataclasses.dataclass
class DataConfig:
  """Plain data-pipeline config; see the module docstring for every field."""

  name: str = "gsm8k"
  path: str | None = None
  split: str = "train"
  eval_fraction: float = 0.0
  eval_split_seed: int = 0
  eval_path: str | None = None
  seq_len: int = 1024
  batch_size: int = 8
  packing: bool = True
  num_packing_bins: int | None = None
  shuffle: bool = True
  shuffle_seed: int = 0
  num_epochs: int | None = 1
  max_examples: int | None = None
  annotated_repeats: int = 1
  drop_remainder: bool = True
  num_threads: int = 4
  prefetch_buffer_size: int = 64
  annotated: bool = False
  annotator: str | None = None
  annotator_args: dict | None = None
  strip_tags: bool = False
  async_sees_full_plan: bool = False
  chunk_bidirectional: bool | str = False

  def __post_init__(self):
    if self.annotated and self.packing:
      raise ValueError("annotated data is one example per row: set packing=False")
    if (self.annotator or self.strip_tags) and not self.annotated:
      raise ValueError("annotator / strip_tags need annotated=True")
    if self.chunk_bidirectional not in (False, True, "auto"):
      raise ValueError(f"chunk_bidirectional must be False, True or 'auto', "
                       f"got {self.chunk_bidirectional!r}")
    if self.seq_len < 1 or self.batch_size < 1:
      raise ValueError(f"seq_len={self.seq_len} and batch_size={self.batch_size} must be >= 1")
    if self.num_epochs is not None and self.num_epochs < 1:
      raise ValueError(f"num_epochs must be >= 1 or None, got {self.num_epochs}")
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
    if not isinstance(self.annotated_repeats, int) or self.annotated_repeats < 1:
      raise ValueError(f"annotated_repeats must be an int >= 1, got {self.annotated_repeats!r}")

  @classmethod
  def from_any(cls, cfg_like: Any) -> "DataConfig":
    """Build from a :class:`DataConfig`, a dataclass, a mapping or a ``ConfigDict``.

    Raises:
      ValueError: on keys that are not fields of :class:`DataConfig` (typos).
      TypeError: if ``cfg_like`` is none of the accepted kinds.
    """
    if isinstance(cfg_like, cls):
      return cfg_like
    if hasattr(cfg_like, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
      d = dict(cfg_like.to_dict())
    elif dataclasses.is_dataclass(cfg_like):
      d = dataclasses.asdict(cfg_like)
    elif isinstance(cfg_like, Mapping):
      d = dict(cfg_like)
    else:
      raise TypeError(f"cannot read a data config from {type(cfg_like).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"unknown data config keys {unknown}; known: {sorted(known)}")
    return cls(**d)


def split_examples(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
  """The chat examples of one split, in file order (before shuffling).

  * ``"train"``: the training file (``cfg.path`` or the default), minus the held-out
    fraction when ``cfg.eval_fraction > 0``;
  * ``"eval"``: the held-out fraction of the training file when ``cfg.eval_fraction > 0``,
    else ``cfg.eval_path`` or the dataset's ``test`` file;
  * any other name (e.g. ``"test"``): the dataset's default file for that split.

  ``cfg.max_examples`` then keeps the first N examples; in the ``"train"`` split an example
  whose record has ``"annotated": true`` is then repeated ``cfg.annotated_repeats`` times in
  place (the shuffle spreads the copies).

  Raises:
    KeyError / ValueError / FileNotFoundError: from :mod:`selforch_jax.data.sources`.
  """
  if split == "train" or (split == "eval" and cfg.eval_fraction > 0):
    exs = sources.load_examples(cfg.name, cfg.path, split="train")
    if cfg.eval_fraction > 0:
      train_idx, eval_idx = sources.heldout_split(len(exs), cfg.eval_fraction,
                                                  cfg.eval_split_seed)
      exs = [exs[i] for i in (train_idx if split == "train" else eval_idx)]
  elif split == "eval":
    exs = sources.load_examples(cfg.name, cfg.eval_path, split="test")
  else:
    exs = sources.load_examples(cfg.name, None, split=split)
  if cfg.max_examples is not None:
    exs = exs[:cfg.max_examples]
  if split == "train" and cfg.annotated_repeats > 1:
    exs = [e for e in exs for _ in range(cfg.annotated_repeats if e.get("annotated") else 1)]
  return exs


class _TokenizeShift:
  """Picklable map: chat example -> shifted, truncated LM example (None if nothing to learn)."""

  def __init__(self, tokenizer: ChatTokenizer, seq_len: int):
    self.tokenizer = tokenizer
    self.seq_len = seq_len

  def __call__(self, example: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    tok = tokenize_chat(example["messages"], self.tokenizer, max_len=self.seq_len + 1)
    if tok["input_ids"].shape[0] < 2:
      return None
    lm = shift_for_lm(tok)
    return lm if lm["loss_mask"].any() else None


def _pad_id(tokenizer: ChatTokenizer) -> int:
  pad = getattr(tokenizer, "pad_id", None)
  return int(pad) if pad is not None else 0


def make_dataset(cfg_like: Any, tokenizer: ChatTokenizer, split: str | None = None,
                 seed: int | None = None, tag_vocab: Any = None) -> grain.IterDataset:
  """The batched input pipeline for one split.

  Args:
    cfg_like: a :class:`DataConfig` or anything :meth:`DataConfig.from_any` accepts.
    tokenizer: a :class:`selforch_jax.data.tokenize.ChatTokenizer`
      (``selforch_jax.tokenizers.Tokenizer``).
    split: ``"train"``, ``"eval"`` or a file split (see :func:`split_examples`);
      None = ``cfg.split``.
    seed: shuffle seed; None = ``cfg.shuffle_seed``. Same seed, same order.
    tag_vocab: the :class:`~selforch_jax.lang.tags.TagVocab` for ``annotated`` data (None: read
      from the tokenizer, which must have the tags).

  Returns:
    A grain ``IterDataset``; iterating yields dicts of numpy ``int32[batch_size, seq_len]``
    arrays ``tokens, targets, loss_mask, segment_ids, positions`` (``annotated``: ``tokens,
    targets, loss_mask, positions`` and ``mask bool[batch_size, seq_len, seq_len]``). ``iter(ds)`` is a
    checkpointable grain ``DatasetIterator`` (``get_state`` / ``set_state``).
    Examples whose assistant tokens are all cut by truncation are skipped.

  Raises:
    ValueError / KeyError / FileNotFoundError: for a bad config or missing files; also
      ValueError if the split has no examples.
  """
  cfg = DataConfig.from_any(cfg_like)
  split = cfg.split if split is None else split
  seed = cfg.shuffle_seed if seed is None else seed
  examples = split_examples(cfg, split)
  if not examples:
    raise ValueError(f"split {split!r} of dataset {cfg.name!r} has no examples")
  ds = grain.MapDataset.source(sources.ListSource(examples, name=f"{cfg.name}/{split}"))
  if cfg.shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(cfg.num_epochs)
  if cfg.annotated:
    from selforch_jax.data.annotated import AnnotateTokenize
    from selforch_jax.lang.tags import TagVocab

    if tag_vocab is None:
      tag_vocab = TagVocab.from_tokenizer(tokenizer)
    fn = AnnotateTokenize(tokenizer, tag_vocab, cfg.seq_len, annotator=cfg.annotator,
                          annotator_args=cfg.annotator_args, strip_tags=cfg.strip_tags,
                          pad_id=_pad_id(tokenizer), async_sees_full_plan=cfg.async_sees_full_plan,
                          chunk_bidirectional=cfg.chunk_bidirectional)
  else:
    fn = _TokenizeShift(tokenizer, cfg.seq_len)
  ds = ds.map(fn).filter(lambda x: x is not None)
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.num_threads,
                                               prefetch_buffer_size=cfg.prefetch_buffer_size))
  pad_id = _pad_id(tokenizer)
  if cfg.annotated:  # rows are already padded to seq_len
    pass
  elif cfg.packing:
    it_ds = packing.pack_dataset(it_ds, cfg.seq_len, cfg.num_packing_bins or cfg.batch_size,
                                 pad_id=pad_id)
  else:
    it_ds = packing.pad_dataset(it_ds, cfg.seq_len, pad_id=pad_id)
  return it_ds.batch(cfg.batch_size, drop_remainder=cfg.drop_remainder)
