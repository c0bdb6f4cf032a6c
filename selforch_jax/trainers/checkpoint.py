"""Orbax checkpoints of a training run: model, optimizer, step, data iterator, config.

One ``ocp.CheckpointManager`` per workdir (``<workdir>/checkpoints``) with items
``state`` (params + frozen params + optimizer state + step, a PyTree), ``data_iter``
(grain's iterator state) and ``config`` (JSON), as MaxText's
``create_orbax_checkpoint_manager`` does. Saves are asynchronous; ``keep`` bounds how
many are kept. Restoring passes abstract arrays with the *current* mesh's shardings, so
a checkpoint written on one mesh restores on another.
"""

from __future__ import annotations

import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx


def to_pure(tree: Any) -> Any:
  """Replace every ``nnx.State`` in ``tree`` by its pure dict (for saving)."""
  return jax.tree.map(lambda x: nnx.to_pure_dict(x) if isinstance(x, nnx.State) else x, tree,
                      is_leaf=lambda x: isinstance(x, nnx.State))


def from_pure(template: Any, pure: Any) -> Any:
  """Inverse of :func:`to_pure`: the leaves of ``pure`` in ``template``'s structure.

  Raises:
    ValueError: if the number of leaves differs (a checkpoint of another model).
  """
  leaves = jax.tree.leaves(pure)
  treedef = jax.tree.structure(template)
  if treedef.num_leaves != len(leaves):
    raise ValueError(f"checkpoint has {len(leaves)} arrays, the model expects {treedef.num_leaves}")
  return jax.tree.unflatten(treedef, leaves)


class Checkpointer:
  """Save / restore a :class:`~selforch_jax.trainers.sft.SFTTrainer` and its data iterator.

  Args:
    workdir: run directory; checkpoints go to ``<workdir>/checkpoints/<step>``.
    save_every: save when ``step % save_every == 0`` (``maybe_save``).
    keep: number of most recent checkpoints kept.
    async_save: write in a background thread (call :meth:`wait` before exiting).
  """

  def __init__(self, workdir: str, save_every: int = 100, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.save_every = max(int(save_every), 1)
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                        create=True)
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=("state", "data_iter", "config"),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                       "data_iter": grain.checkpoint.CheckpointHandler(),
                       "config": ocp.JsonCheckpointHandler()},
        options=opts)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, trainer, data_iter, config_json: dict, force: bool = False) -> bool:
    """Save the trainer's state at ``trainer.step``. Returns whether a save started."""
    sd = trainer.state_dict()
    state = {"params": sd["params"], "frozen": sd["frozen"], "opt_state": to_pure(sd["opt_state"]),
             "step": sd["step"]}
    return self.manager.save(
        trainer.step, force=force,
        args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                data_iter=grain.checkpoint.CheckpointSave(data_iter),
                                config=ocp.args.JsonSave(config_json)))

  def maybe_save(self, trainer, data_iter, config_json: dict) -> bool:
    if trainer.step % self.save_every == 0:
      return self.save(trainer, data_iter, config_json)
    return False

  def restore(self, trainer, data_iter, step: int | None = None) -> int:
    """Restore ``step`` (default latest) into ``trainer`` and ``data_iter`` in place.

    Returns:
      the restored step.

    Raises:
      FileNotFoundError: if there is no checkpoint.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    abstract = trainer.abstract_state_dict()
    target = {"params": abstract["params"], "frozen": abstract["frozen"],
              "opt_state": to_pure(abstract["opt_state"]), "step": 0}
    restore_args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding) if hasattr(x, "sharding") else
        ocp.RestoreArgs(), target)
    items = {"state": ocp.args.PyTreeRestore(item=target, restore_args=restore_args)}
    if data_iter is not None:
      items["data_iter"] = grain.checkpoint.CheckpointRestore(data_iter)
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    st = out["state"]
    trainer.load_state_dict({"params": st["params"], "frozen": st["frozen"],
                             "opt_state": from_pure(trainer.opt_state, st["opt_state"]),
                             "step": st["step"]})
    return step

  def all_steps(self) -> list[int]:
    """The steps of the checkpoints kept, ascending."""
    return sorted(int(s) for s in self.manager.all_steps())

  def restore_config(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

  def wait(self) -> None:
    """Block until pending async saves are committed."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
