"""Config dataclasses that validate themselves, generate their command line and travel as JSON.

A config is a tree of frozen kw-only dataclasses. A field made with ``option(...)`` is one
command-line flag (``--field-name`` unless ``flag=`` says otherwise); its type annotation gives
the argparse type, its metadata the help, the choices and the bounds. A field made with
``section(Cls)`` holds another such dataclass whose options are flags too: the command line is
flat, so option names are unique across the tree (``add_arguments`` checks). Every class calls
``check_options(self)`` first in ``__post_init__`` and adds its cross-field rules after it::

    @dataclass(frozen=True, kw_only=True)
    class OptimOptions:
        lr: float = option(3e-3, help="peak learning rate", above=0)

        def __post_init__(self) -> None:
            check_options(self)

Supported option types: ``bool`` (a ``--flag`` switch when the default is False, else
``--flag/--no-flag``), ``int``, ``float``, ``str``, any of them ``| None``, and
``tuple[str, ...]`` (a comma list on the command line, a list in JSON). Errors are one line and
name the flag: a wrong value usually comes from the command line, and a JSON config is only
ever written from a validated object.

Pure Python (no torch, nothing from amsp_ext but choices).
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from amsp_ext.choices import OPTION_KEY, check_bool, check_int, check_number, check_one_of, parse_size

__all__ = [
    "Option", "add_arguments", "check_options", "flag_of", "from_dict", "from_json", "name_of",
    "from_namespace", "option", "options", "section", "to_dict", "to_json",
]

_KEY = OPTION_KEY


@dataclass(frozen=True, kw_only=True)
class Option:
    """What ``option()`` stores in a field's metadata."""

    help: str = ""
    flag: str | None = None  # None: --field-name
    choices: tuple[str, ...] | None = None
    minimum: float | None = None  # value >= minimum
    above: float | None = None  # value > above
    below: float | None = None  # value < below
    metavar: str | None = None
    size: bool = False  # an int of bytes that may also be given as a size ("25MiB")
    short: str | None = None  # a second spelling of the flag ("-o")
    required: bool = False  # the command line must give it (its default is then None)
    one_of: str | None = None  # the options sharing this name are mutually exclusive


def option(default: Any, *, help: str = "", flag: str | None = None, choices=None,
           minimum: float | None = None, above: float | None = None,
           below: float | None = None, metavar: str | None = None, size: bool = False,
           short: str | None = None, required: bool = False, one_of: str | None = None) -> Any:
    """A leaf field: one flag. ``choices`` may be any iterable of strings (kept as a tuple).
    ``size=True`` (an ``int`` field): bytes, also given as a size with a unit, "25MiB".
    ``one_of``: a name shared by options of which the command line takes at most one (exactly
    one if any of them is ``required``)."""
    meta = Option(help=help, flag=flag, choices=tuple(choices) if choices is not None else None,
                  minimum=minimum, above=above, below=below, metavar=metavar, size=size,
                  short=short, required=required, one_of=one_of)
    return field(default=default, metadata={_KEY: meta})


def section(cls: type) -> Any:
    """A field holding a sub-config (its options are flags of the same command line)."""
    return field(default_factory=cls)


# [Note: errors name what the user wrote]
# A config built from the command line names a bad value by its flag (``--granularity``); one read
# from JSON (a ds_config's "amsp" block, the workers' config file) by its key path
# (``amsp.granularity``); one built in Python by the class's ``SCHEMA_NAME`` path if it has one
# (``ShardConfig(timeout=-1)``: ``config.timeout``), else by its flag. ``from_dict`` and
# ``from_namespace`` set the naming for the checks their constructors run.
_FLAGS = "--"
_WHERE: contextvars.ContextVar[str | None] = contextvars.ContextVar("amsp_schema_where", default=None)


def _name_of(obj: Any, f: dataclasses.Field, *, flag: bool = True) -> str:
    where = _WHERE.get()
    if where is None:
        where = getattr(type(obj), "SCHEMA_NAME", _FLAGS)
    if where == _FLAGS:
        return flag_of(f) if flag else f.name
    return f"{where}.{f.name}"


def name_of(obj: Any, field_name: str) -> str:
    """How an error about ``obj.field_name`` names it (flag, key path or Python path; see the
    Note above), for the cross-field rules of a ``__post_init__``."""
    f = next(x for x in fields(obj) if x.name == field_name)
    return _name_of(obj, f, flag=_meta(f) is not None)


def _meta(f: dataclasses.Field) -> Option | None:
    meta = f.metadata.get(_KEY)
    if isinstance(meta, typing.Mapping):  # choices.described ([Note: a field described below the schema])
        meta = Option(**{k: tuple(v) if k == "choices" else v for k, v in meta.items()})
    return meta


def flag_of(f: dataclasses.Field) -> str:
    meta = _meta(f)
    return (meta.flag if meta and meta.flag else None) or "--" + f.name.replace("_", "-")


def _kind(cls: type, name: str) -> tuple[type, bool, bool]:
    """``(base type, optional, is a tuple of it)`` of field ``name`` of ``cls``."""
    t = typing.get_type_hints(cls)[name]
    optional = False
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"{cls.__name__}.{name}: an option is one type or that type | None")
        optional, t = True, args[0]
    if typing.get_origin(t) is tuple:
        return typing.get_args(t)[0], optional, True
    return t, optional, False


def _is_section(cls: type, f: dataclasses.Field) -> bool:
    t = typing.get_type_hints(cls)[f.name]
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def options(cls: type) -> list[tuple[type, dataclasses.Field]]:
    """Every option field of the tree under ``cls``, depth first, with the class that has it."""
    out = []
    for f in fields(cls):
        if _is_section(cls, f):
            out += options(typing.get_type_hints(cls)[f.name])
        elif _meta(f) is not None:
            out.append((cls, f))
    return out


# -- validation ----------------------------------------------------------------------------------

def check_options(obj: Any) -> None:
    """Check every option field of ``obj`` (not its sections: they checked themselves) against
    its type, choices and bounds. Floats given as ints become floats; lists become tuples."""
    cls = type(obj)
    for f in fields(obj):
        meta = _meta(f)
        if meta is None:
            want = typing.get_type_hints(cls)[f.name]
            if _is_section(cls, f) and not isinstance(getattr(obj, f.name), want):
                article = "an" if want.__name__[0] in "AEIOU" else "a"
                raise ValueError(f"{_name_of(obj, f, flag=False)} must be {article} {want.__name__}, "
                                 f"got {type(getattr(obj, f.name)).__name__}")
            continue
        name, value = _name_of(obj, f), getattr(obj, f.name)
        base, optional, many = _kind(cls, f.name)
        if value is None and optional:
            continue
        if many:
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(obj, f.name, value)
            if not isinstance(value, tuple):
                raise ValueError(f"{name} must be a list, got {value!r}")
            for v in value:
                _check_one(v, base, name, meta)
        else:
            value = _check_one(value, base, name, meta)
            object.__setattr__(obj, f.name, value)


def _check_one(value: Any, base: type, name: str, meta: Option) -> Any:
    if base is bool:
        check_bool(value, name)
    elif base is int:
        if meta.size and isinstance(value, str):  # "25MiB", or a plain count of bytes
            value = int(value.strip()) if value.strip().isdigit() else parse_size(
                value, field=name, allow_zero=meta.minimum is not None and meta.minimum <= 0)
        check_int(value, name, minimum=meta.minimum)
        if meta.above is not None or meta.below is not None:
            check_number(value, name, above=meta.above, below=meta.below)
    elif base is float:
        check_number(value, name, minimum=meta.minimum, above=meta.above, below=meta.below)
        value = float(value)
    elif base is str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    else:
        raise TypeError(f"{name}: unsupported option type {base.__name__}")
    if meta.choices is not None:
        check_one_of(value, meta.choices, name)
    return value


# -- command line --------------------------------------------------------------------------------

def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(parser, cls: type, *, only: tuple[str, ...] | None = None,
                  unset: tuple[str, ...] = ()) -> None:
    """One flag per option of the tree under ``cls`` (``only``: of those fields); defaults are the
    dataclasses' defaults, except the ``unset`` fields' flags, whose default is None: the
    command fills them when not given (a preset, a check of this machine) before it builds the
    config. ``parser`` may be an argument group."""
    seen: dict[str, str] = {}
    chosen = [(owner, f) for owner, f in options(cls) if only is None or f.name in only]
    groups: dict[str, Any] = {}
    for name in dict.fromkeys(_meta(f).one_of for _, f in chosen if _meta(f).one_of):
        groups[name] = parser.add_mutually_exclusive_group(
            required=any(_meta(f).required for _, f in chosen if _meta(f).one_of == name))
    for owner, f in chosen:
        if f.name in seen:
            raise TypeError(f"option {f.name!r} is in both {seen[f.name]} and {owner.__name__}: "
                            f"option names must be unique across a config tree")
        seen[f.name] = owner.__name__
        meta = _meta(f)
        base, _, many = _kind(owner, f.name)
        help_ = meta.help
        default = None if f.name in unset else f.default
        if default not in (None, False, (), ""):
            help_ = f"{help_} (default: %(default)s)" if help_ else "default: %(default)s"
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": help_ or None}
        if base is bool and not many:
            kw["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        elif many:
            kw["type"] = _comma_list
            kw["metavar"] = meta.metavar or "A,B"
            if meta.choices:
                kw["help"] = f"{help_ + ': ' if help_ else ''}comma list of {', '.join(meta.choices)}"
        else:
            kw["type"] = str if meta.size else base  # a size is parsed (and checked) by check_options
            if meta.size:
                kw["metavar"] = meta.metavar or "SIZE"
            if meta.choices is not None and base is str:
                kw["choices"] = meta.choices
            if meta.metavar:
                kw["metavar"] = meta.metavar
        if meta.required and meta.one_of is None:
            kw["required"] = True
        names = (meta.short, flag_of(f)) if meta.short else (flag_of(f),)
        (groups[meta.one_of] if meta.one_of else parser).add_argument(*names, **kw)


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """The config of the parsed flags (``add_arguments(parser, cls)``); raises the one-line
    ValueError of the first bad value, naming its flag."""
    token = _WHERE.set(_FLAGS)
    try:
        return _from_namespace(cls, ns)
    finally:
        _WHERE.reset(token)


def _from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    kw = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if _is_section(cls, f):
            kw[f.name] = _from_namespace(hints[f.name], ns)
        elif _meta(f) is not None and hasattr(ns, f.name):  # add_arguments(only=...) may skip some
            kw[f.name] = getattr(ns, f.name)
    return cls(**kw)


# -- JSON ----------------------------------------------------------------------------------------

def to_dict(obj: Any) -> dict[str, Any]:
    """The JSON form: one object per section, tuples as lists."""
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else list(v) if isinstance(v, tuple) else v
    return out


def from_dict(cls: type, data: Any, *, where: str = "config") -> Any:
    """The inverse of ``to_dict``; an unknown key is a one-line error naming it. Missing keys
    take their defaults."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(known)}")
    kw = {}
    for name, v in data.items():
        if _is_section(cls, known[name]):
            kw[name] = from_dict(hints[name], v, where=f"{where}.{name}")
        elif (sub := _optional_dataclass(hints[name])) is not None and v is not None:
            # a sub-config that may be absent (ShardConfig.auto, .adaptive): its own from_dict
            # if it has one (its errors name its keys), else the same walk
            reader = getattr(sub, "from_dict", None)
            kw[name] = reader(v, where=f"{where}.{name}") if reader else from_dict(sub, v, where=f"{where}.{name}")
        else:
            kw[name] = v
    token = _WHERE.set(where)
    try:
        return cls(**kw)
    finally:
        _WHERE.reset(token)


def _optional_dataclass(t: Any) -> type | None:
    """``X`` of a ``X | None`` annotation where X is a dataclass, else None."""
    if typing.get_origin(t) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def to_json(obj: Any) -> str:
    return json.dumps(to_dict(obj), sort_keys=True)


def from_json(cls: type, text: str) -> Any:
    return from_dict(cls, json.loads(text))

