"""MkDocs hook: the config reference, generated from `dad_integrations.config.DADConfig`.

A page holding the marker ``<!-- config-reference -->`` gets, in its place, a table of every
dataclass field of `DADConfig` (name, type, default) and one section per field with the field's
description, parsed from the ``Attributes:`` (or ``Args:``) section of the class docstring. Nothing
here repeats a key, a default or a description: change `config.py` and the page follows.

The build fails (`PluginError`) when a field has no description in the docstring, or the docstring
describes a key that is not a field, so the page cannot drift from the code.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
from typing import Any, Dict, List, Tuple

from mkdocs.exceptions import PluginError

MARKER = "<!-- config-reference -->"
# the keys whose values come from a fixed set, and the constant of `dad_integrations.config` that
# holds it (the values are read from the module; a constant that is gone fails the build)
CHOICES = {"mode": "MODES", "rank_route": "RANK_ROUTES", "wire_dtype": "WIRE_DTYPES",
           "layer_kinds": "LAYER_KINDS", "objective": "OBJECTIVES", "uncaptured_matrices": "UNCAPTURED_MATRICES"}
SECTION_NAMES = ("Attributes", "Args", "Arguments", "Parameters")
_SECTION = re.compile(r"^(?P<indent>\s*)(?P<name>" + "|".join(SECTION_NAMES) + r"):\s*$")
_ENTRY = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*(\([^)]*\))?:\s*(?P<text>.*)$")


def parse_field_docs(doc: str) -> Dict[str, str]:
    """``{field: description}`` from a Google-style ``Attributes:`` / ``Args:`` section.

    An entry is ``name: text`` one indentation step below the section title; deeper-indented lines
    continue it; a line at or above the title's indentation ends the section.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    out: Dict[str, str] = {}
    i = 0
    while i < len(lines):
        match = _SECTION.match(lines[i])
        i += 1
        if not match:
            continue
        title_indent = len(match.group("indent"))
        entry_indent = None
        current = None
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                i += 1
                continue
            indent = len(line) - len(line.lstrip())
            if indent <= title_indent:
                break
            if entry_indent is None:
                entry_indent = indent
            if indent == entry_indent:
                entry = _ENTRY.match(line.strip())
                if not entry:
                    raise PluginError(f"config reference: cannot parse docstring line {line.strip()!r}")
                current = entry.group("name")
                out[current] = entry.group("text").strip()
            elif current is not None:
                out[current] = (out[current] + " " + line.strip()).strip()
            i += 1
    return out


def _value(value: Any) -> str:
    """A default as the Python literal a user writes (strings in double quotes, as in JSON)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        inner = ", ".join(_value(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def _default(field: dataclasses.Field) -> Tuple[str, str]:
    """(short default for the table, longer note for the field's section)."""
    if field.default is not dataclasses.MISSING:
        text = f"`{_value(field.default)}`"
        return text, text
    factory = field.default_factory
    if factory is not dataclasses.MISSING:
        name = f"`{getattr(factory, '__name__', 'factory')}()`"
        summary = inspect.cleandoc(factory.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        return name, f"{name}: {summary}" if summary else name
    return "required", "required"


def _type(field: dataclasses.Field) -> str:
    annotation = field.type if isinstance(field.type, str) else inspect.formatannotation(field.type)
    return f"`{annotation}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _choices(module: Any, name: str) -> str:
    constant = CHOICES.get(name)
    if constant is None:
        return ""
    if not hasattr(module, constant):
        raise PluginError(f"config reference: dad_integrations.config has no {constant} (the values of {name!r})")
    values = ", ".join(f"`{_value(v)}`" for v in getattr(module, constant))
    return f" &nbsp; **Values:** {values}"


def render() -> str:
    from dad_integrations import config as module  # the build fails if the package does not import

    DADConfig = module.DADConfig

    fields = dataclasses.fields(DADConfig)
    docs = parse_field_docs(DADConfig.__doc__)
    names = [f.name for f in fields]
    missing = [n for n in names if n not in docs]
    unknown = [n for n in docs if n not in names]
    if missing or unknown:
        raise PluginError(f"config reference: DADConfig's docstring does not describe field(s) {missing}"
                          f" / describes non-field(s) {unknown}")

    rows: List[str] = ["| key | type | default |", "|---|---|---|"]
    sections: List[str] = []
    for field in fields:
        short, long = _default(field)
        rows.append(f"| [`{field.name}`](#{field.name}) | {_cell(_type(field))} | {_cell(short)} |")
        sections += [
            f"### `{field.name}` {{#{field.name}}}",
            "",
            f"**Type:** {_type(field)} &nbsp; **Default:** {long}{_choices(module, field.name)}",
            "",
            docs[field.name],
            "",
        ]
    return "\n".join(rows + ["", "## Keys", ""] + sections)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
