"""Build a service's config dataclass at the edge: environment variables, then CLI flags.

Every field F of the dataclass can be set by <PREFIX><F upper case> (how docker-compose configures a
service) and by --f-with-dashes on the command line, which overrides the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def _caster(type_name: Any) -> Callable[[str], Any]:
    t = str(type_name)
    if t.startswith("int"):
        return int
    if t.startswith("float"):
        return float
    if t.startswith("bool"):
        return lambda s: str(s).strip().lower() in ("1", "true", "yes", "on")
    return str


def from_env(cls: type[T], prefix: str, env: dict[str, str] | None = None) -> T:
    env = dict(os.environ if env is None else env)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name.upper()
        if key in env:
            try:
                kwargs[f.name] = _caster(f.type)(env[key])
            except ValueError as e:
                raise ValueError(f"environment variable {key}={env[key]!r}: {e}") from None
    return cls(**kwargs)


def from_args(cls: type[T], prefix: str, argv: list[str] | None, prog: str, description: str) -> T:
    base = from_env(cls, prefix)
    ap = argparse.ArgumentParser(prog=prog, description=description,
                                 epilog=f"Every flag can also be set as an environment variable {prefix}<FLAG>.")
    for f in dataclasses.fields(cls):
        ap.add_argument("--" + f.name.replace("_", "-"), default=getattr(base, f.name), type=_caster(f.type),
                        metavar=str(f.type).upper())
    return cls(**vars(ap.parse_args(argv)))
