"""A command line generated from typed functions and dataclasses.

Each subcommand is a function; its parameters (and the fields of one optional dataclass it takes)
become `--kebab-case` options with their types, defaults and docstring help. Booleans are flags
(`--json`, `--no-json`). `--config FILE` (YAML or JSON) supplies values for any option; the
command line overrides it. Errors are one line on stderr and exit code 2.

Why not jsonargparse: dlm's interface uses dashed option names (--max-steps) and bare boolean
flags (--resume, --json), which jsonargparse does not generate.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, get_args, get_origin


@dataclass
class Command:
    fn: Callable[..., Any]
    config: type | None = None  # a dataclass whose fields are options too; passed to fn as `config_param`
    config_param: str = "cfg"
    name: str | None = None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, exit 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _doc_args(fn: Callable | type) -> tuple[str, dict[str, str]]:
    """Summary line and per-argument help from a Google-style docstring (Args: / Attributes:)."""
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n")[0].replace("\n", " ")
    helps: dict[str, str] = {}
    m = re.search(r"^(Args|Attributes):\s*$(.*?)(?=^\S|\Z)", doc, re.M | re.S)
    if m:
        cur = None
        for line in m.group(2).splitlines():
            mm = re.match(r"^\s{2,4}(\w+)(?:\s*\(.*?\))?:\s*(.*)$", line)
            if mm:
                cur = mm.group(1)
                helps[cur] = mm.group(2)
            elif cur and line.strip():
                helps[cur] += " " + line.strip()
    return summary, helps


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _add_option(p: argparse.ArgumentParser, name: str, tp: Any, default: Any, help_: str) -> None:
    flag = "--" + name.replace("_", "-")
    names = [flag] + (["--" + name] if "_" in name else [])
    tp, optional = _strip_optional(tp)
    required = default is inspect.Parameter.empty
    kw: dict[str, Any] = {"dest": name, "help": help_ or None, "default": argparse.SUPPRESS}
    if tp is bool:
        p.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        return
    if get_origin(tp) is Literal:
        kw["choices"] = list(get_args(tp))
        tp = type(kw["choices"][0])
    elif get_origin(tp) is list:
        (inner,) = get_args(tp)
        kw["nargs"] = "+"
        tp = inner
    kw["type"] = tp if tp in (int, float, str) else str
    if not required and default is not None:
        kw["help"] = f"{help_} (default: {default})" if help_ else f"default: {default}"
    kw["metavar"] = name.upper()
    if required:
        kw["required"] = True
    p.add_argument(*names, **kw)


def _params(cmd: Command) -> list[tuple[str, Any, Any, str]]:
    """(name, type, default, help) of every option of a command."""
    hints = typing.get_type_hints(cmd.fn)
    _, helps = _doc_args(cmd.fn)
    out = []
    for name, prm in inspect.signature(cmd.fn).parameters.items():
        if cmd.config is not None and name == cmd.config_param:
            continue
        out.append((name, hints.get(name, str), prm.default, helps.get(name, "")))
    if cmd.config is not None:
        chints = typing.get_type_hints(cmd.config)
        _, chelps = _doc_args(cmd.config)
        for f in dataclasses.fields(cmd.config):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out.append((f.name, chints[f.name], default, chelps.get(f.name, "")))
    return out


def _load_config(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise SystemExit(_fail(f"--config: no such file: {path}"))
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise different error types
        raise SystemExit(_fail(f"--config {path}: cannot parse ({str(e).splitlines()[0]})"))
    if not isinstance(data, dict):
        raise SystemExit(_fail(f"--config {path}: expected a mapping of option names to values"))
    return {k.replace("-", "_"): v for k, v in data.items()}


def _coerce(name: str, tp: Any, value: Any, source: str | None) -> Any:
    """Check a value from a config file against the option's type."""
    base, optional = _strip_optional(tp)
    if value is None and optional:
        return None
    try:
        if base is bool:
            if not isinstance(value, bool):
                raise ValueError
            return value
        if get_origin(base) is list:
            (inner,) = get_args(base)
            return [inner(v) for v in (value if isinstance(value, list) else [value])]
        if get_origin(base) is Literal:
            if value not in get_args(base):
                raise ValueError
            return value
        if base in (int, float, str):
            if base is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return base(value)
    except (TypeError, ValueError):
        raise SystemExit(_fail(f"--config {source}: option {name!r} must be {getattr(base, '__name__', base)}, got {value!r}"))
    return value


def _fail(message: str) -> int:
    sys.stderr.write(f"dlm: error: {message}\n")
    return 2


def build_parser(prog: str, description: str, commands: dict[str, Command]) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="_command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name, cmd in commands.items():
        summary, _ = _doc_args(cmd.fn)
        sp = sub.add_parser(name, help=summary, description=summary)
        sp.add_argument("--config", dest="_config", default=None, metavar="FILE",
                        help="YAML or JSON file of option values (the command line overrides it)")
        for pname, tp, default, help_ in _params(cmd):
            _add_option(sp, pname, tp, default, help_)
    return parser


def run(prog: str, description: str, commands: dict[str, Command], argv: list[str] | None = None) -> Any:
    """Parse argv, call the command; returns what it returns."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # options required on the command line may come from --config instead: parse leniently first
    parser = build_parser(prog, description, commands)
    cfg_path = None
    if "--config" in argv:
        i = argv.index("--config")
        cfg_path = argv[i + 1] if i + 1 < len(argv) else None
    from_file = _load_config(cfg_path) if cfg_path else {}
    if from_file:
        # relax `required` for options the file provides
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for sp in subparsers.choices.values():
            for a in sp._actions:
                if a.dest in from_file:
                    a.required = False
    ns = vars(parser.parse_args(argv))
    name = ns.pop("_command")
    ns.pop("_config", None)
    cmd = commands[name]
    params = _params(cmd)
    known = {p[0] for p in params}
    unknown = sorted(set(from_file) - known)
    if unknown:
        raise SystemExit(_fail(f"--config {cfg_path}: unknown options {unknown} for `{prog} {name}`"))
    values: dict[str, Any] = {}
    for pname, tp, default, _ in params:
        if pname in ns:
            values[pname] = ns[pname]
        elif pname in from_file:
            values[pname] = _coerce(pname, tp, from_file[pname], cfg_path)
        elif default is not inspect.Parameter.empty:
            values[pname] = default
    if cmd.config is not None:
        fields = {f.name for f in dataclasses.fields(cmd.config)}
        values[cmd.config_param] = cmd.config(**{k: values.pop(k) for k in list(values) if k in fields})
    return cmd.fn(**values)
