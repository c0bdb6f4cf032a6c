"""Chat templates: HF-style jinja2 templates rendered the way ``transformers`` renders them."""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template"]


class _GenerationTag(jinja2.ext.Extension):
  """Accepts HF's ``{% generation %}...{% endgeneration %}`` and renders the body unchanged."""

  tags = {"generation"}

  def parse(self, parser):  # noqa: D102 - jinja2 hook
    next(parser.stream)
    return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Like HF: no HTML escaping (jinja's builtin tojson escapes <, >, &, ').
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile_chat_template(template: str) -> jinja2.Template:
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=[_GenerationTag, jinja2.ext.loopcontrols],
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(template)


def render_chat_template(
  template: str,
  messages: Sequence[Mapping[str, Any]],
  *,
  add_generation_prompt: bool = True,
  bos_token: str | None = None,
  eos_token: str | None = None,
  **kwargs: Any,
) -> str:
  """Render a (HF-style, jinja2) chat template the way ``transformers`` does.

  The template runs in jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
  ``lstrip_blocks``, the ``loopcontrols`` extension, HF's ``{% generation %}`` tag (a no-op
  here), a ``tojson`` filter without HTML escaping, and the globals ``raise_exception(msg)`` and
  ``strftime_now(fmt)``.

  Args:
    template: the jinja2 source.
    messages: the conversation, e.g. ``[{"role": "user", "content": "Hi"}]``.
    add_generation_prompt: render the opening of an assistant turn at the end.
    bos_token: text of the BOS token, exposed to the template as ``bos_token``.
    eos_token: text of the EOS token, exposed as ``eos_token``.
    **kwargs: further template variables (``tools``, ``pad_token``, ...).

  Returns:
    str: the rendered prompt text.

  Raises:
    jinja2.TemplateError: the template does not parse, or called ``raise_exception``.
  """
  compiled = _compile_chat_template(template)
  return compiled.render(
    messages=list(messages),
    add_generation_prompt=add_generation_prompt,
    bos_token=bos_token,
    eos_token=eos_token,
    **kwargs,
  )
