"""How `pal --help` reads: like `docker` or `gh`, not like a Python signature.

typer 0.29 (pinned) shows a ``<type>`` for every parameter, flags and ``--help`` included
(``--json <bool>``), and wraps required arguments in braces in the usage line
(``{vm_id}``). Here: flags show no type, a value option shows its metavar or a plain word
(``string``, ``int``, ``float``, ``path``), arguments are named in capitals (``VM``,
``COMMAND...``, ``[PATH]``), and each command's examples go in its epilog
(:func:`examples`). Applied once, on import, by pal/cli/main.py; tests/e2e/test_cli.py
checks the shape of the help.
"""

from __future__ import annotations

from typing import Any

import click
from typer.core import TyperArgument, TyperOption

_WORDS = {"str": "string", "int": "int", "float": "float", "Path": "path", "bool": "bool"}


def _value_word(param: TyperOption | TyperArgument) -> str:
    annotation = param.type_descriptor.annotation
    name = getattr(annotation, "__name__", str(annotation))
    if name == "list":  # list[str]: the element's word (the help says "repeatable")
        args = getattr(annotation, "__args__", None) or (str,)
        name = getattr(args[0], "__name__", "str")
    return _WORDS.get(name, "value")


def _option_type(self: TyperOption, ctx: click.Context) -> str | None:
    if self.is_flag or self.count:
        return None
    return self.metavar or _value_word(self)


def _argument_name(self: TyperArgument) -> str:
    return self.metavar or (self.name or "").upper()


def _argument_usage(self: TyperArgument) -> str:
    name = _argument_name(self)
    if self.nargs != 1:
        name += "..."
    return name if self.required else f"[{name}]"


def _argument_type(self: TyperArgument, ctx: click.Context) -> str | None:
    return None  # the name says it (VM, PATH); the help says the rest


def install() -> None:
    patches: dict[tuple[type, str], Any] = {
        (TyperOption, "display_type_rich"): _option_type,
        (TyperArgument, "display_type_rich"): _argument_type,
        (TyperArgument, "_usage_display_name"): _argument_usage,
        (TyperArgument, "display_name_raw"): property(_argument_name),
    }
    for (cls, name), fn in patches.items():
        # A typer upgrade that renamed these would silently bring the old help back.
        assert hasattr(cls, name), f"typer.core.{cls.__name__}.{name} is gone: update pal/cli/help.py"
        setattr(cls, name, fn)


def examples(*lines: str) -> str:
    """An epilog of examples, one command per line, shown under the options."""
    return "Examples:\n" + "\n".join(f"  {line}" for line in lines)
