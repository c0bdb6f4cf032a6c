"""Named registries: one small piece behind every "choose it by name in a config" lookup
(annotators, schedulers, rewards), so that each system adds its parts with a decorator."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
  """Name -> object (usually a factory or a function), filled by the :meth:`register` decorator.

  Args:
    kind: what the entries are (``"annotator"``, ``"scheduler"``, ``"reward"``), used in errors.
    missing_error: the exception type :meth:`get` raises for an unknown name.
  """

  def __init__(self, kind: str, missing_error: type[Exception] = KeyError):
    self.kind = kind
    self.missing_error = missing_error
    self._entries: dict[str, T] = {}

  def register(self, name: str) -> Callable[[T], T]:
    """Decorator: store the decorated object under ``name`` and return it unchanged.

    Raises:
      ValueError: ``name`` is already registered.
    """

    def deco(obj: T) -> T:
      if name in self._entries:
        raise ValueError(f"{self.kind} {name!r} is already registered")
      self._entries[name] = obj
      return obj

    return deco

  def names(self) -> list[str]:
    """The registered names, sorted."""
    return sorted(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def get(self, name: str) -> T:
    """The object registered as ``name``.

    Raises:
      ``missing_error`` (KeyError by default): unknown ``name``; the message lists the known ones.
    """
    if name not in self._entries:
      raise self.missing_error(f"unknown {self.kind} {name!r}; known: {self.names()}")
    return self._entries[name]
