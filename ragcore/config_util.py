"""Build a service's config dataclass at the edge: environment variables, then CLI flags.

Every field F of the dataclass can be set by <PREFIX><F upper case> (how docker-compose configures a
service) and by --f-with-dashes on the command line, which overrides the environment.

`--help` lists every flag with a one-line description, its default and its environment variable. The
descriptions live in a table next to each config class (`{field name: text}`), not in the fields themselves:
the comments above the fields say why a default is what it is, the table says what the flag does;
`missing_help` lists fields without a description (a test keeps it empty).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any, Callable, ClassVar, Mapping, TypeVar

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


def env_name(prefix: str, field_name: str) -> str:
    return prefix + field_name.upper()


def from_env(cls: type[T], prefix: str, env: dict[str, str] | None = None) -> T:
    env = dict(os.environ if env is None else env)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = env_name(prefix, f.name)
        if key in env:
            try:
                kwargs[f.name] = _caster(f.type)(env[key])
            except ValueError as e:
                raise ValueError(f"environment variable {key}={env[key]!r}: {e}") from None
    return cls(**kwargs)


def missing_help(cls: type, help: Mapping[str, str]) -> list[str]:
    """Fields of cls without a description in `help` (and descriptions of fields that do not exist)."""
    names = [f.name for f in dataclasses.fields(cls)]
    return [n for n in names if not help.get(n, "").strip()] + [f"{n} (no such field)" for n in help
                                                                  if n not in names]


def _shown(value: Any) -> str:
    return '""' if value == "" else str(value)


def parser(cls: type[T], prefix: str, prog: str, description: str, help: Mapping[str, str],
           base: T | None = None) -> argparse.ArgumentParser:
    """The argument parser of a config class: one flag per field, defaults from `base` (the environment)."""
    ap = argparse.ArgumentParser(
        prog=prog, description=description,
        epilog=f"Every flag can also be set as an environment variable {prefix}<FLAG> (shown per flag); "
               "a flag given on the command line wins over the environment.")
    for f in dataclasses.fields(cls):
        default = getattr(base, f.name) if base is not None else f.default
        env = env_name(prefix, f.name)
        origin = f"default {_shown(default)}" + (" (from the environment)" if env in os.environ else "")
        text = f"{help.get(f.name) or '(undocumented)'} [{origin}; env {env}]"
        # argparse expands %-format in help texts: escape literal % signs.
        ap.add_argument("--" + f.name.replace("_", "-"), default=default, type=_caster(f.type),
                        metavar=str(f.type).upper(), help=text.replace("%", "%%"))
    return ap


def from_args(cls: type[T], prefix: str, argv: list[str] | None, prog: str, description: str,
              help: Mapping[str, str] | None = None) -> T:
    base = from_env(cls, prefix)
    ap = parser(cls, prefix, prog, description, help or {}, base)
    return cls(**vars(ap.parse_args(argv)))


LOG_LEVELS = ("debug", "info", "warning", "error")

# One-line help of the flags every service's gRPC shell has (metrics endpoint, auth, TLS); each service's
# FLAG_HELP includes it.
SHELL_FLAG_HELP = {
    "log_level": "log verbosity: debug | info | warning | error (debug adds per-step decisions, e.g. RaLM round gates)",
    "metrics_port": "Prometheus /metrics HTTP port (0 = off)",
    "metrics_host": "address /metrics binds to; loopback by default (0.0.0.0 exposes it: add TLS and basic auth)",
    "metrics_tls_cert": "PEM certificate to serve /metrics over HTTPS (with --metrics-tls-key; \"\" = plain HTTP)",
    "metrics_tls_key": "PEM private key of --metrics-tls-cert",
    "metrics_tls_client_ca": "PEM CA whose client certificates /metrics requires (mutual TLS; \"\" = none)",
    "metrics_auth_file": "file holding user:password that scrapes must send as HTTP basic auth (\"\" = none)",
    "auth_token": "bearer token every RPC must carry, health excepted (\"\" = no auth)",
    "auth_token_file": "file holding the bearer token (wins over --auth-token)",
    "tls_cert": "PEM certificate to serve gRPC over TLS (with --tls-key; \"\" = plaintext)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA that client certificates must be signed by (mutual TLS; \"\" = no client certs)",
}


@dataclasses.dataclass
class ShellConfig:
    """The fields every gRPC service has (its shell: metrics endpoint, auth, TLS) and how a service config is built
    at the edge. A service config extends it and sets ENV_PREFIX, PROG, DESCRIPTION and FLAG_HELP (its own lines
    plus SHELL_FLAG_HELP)."""

    ENV_PREFIX: ClassVar[str] = ""
    PROG: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""
    FLAG_HELP: ClassVar[Mapping[str, str]] = SHELL_FLAG_HELP

    log_level: str = "info"
    # Prometheus /metrics port (ragcore/metrics.py); 0 = off. It binds to loopback unless metrics_host says
    # otherwise: exposed beyond the host, give it TLS (metrics_tls_*) and basic auth (metrics_auth_file holding
    # "user:password"), or a scraper on the same network reads it unauthenticated.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_tls_cert: str = ""
    metrics_tls_key: str = ""
    metrics_tls_client_ca: str = ""
    metrics_auth_file: str = ""
    # Bearer token every RPC must carry (`authorization: Bearer <token>`; health is exempt); "" = off.
    # auth_token_file (e.g. /run/secrets/ragserve_token) wins over auth_token (ragcore/security.py).
    auth_token: str = ""
    auth_token_file: str = ""
    # TLS: PEM certificate + key; tls_client_ca also requires client certificates signed by it. "" = plaintext.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""

    def configure_logging(self) -> None:
        """The process's log format and level; called once by the service's entry point."""
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        logging.basicConfig(level=self.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    @classmethod
    def from_env(cls: type[T], env: dict[str, str] | None = None) -> T:
        return from_env(cls, cls.ENV_PREFIX, env)

    @classmethod
    def from_args(cls: type[T], argv: list[str] | None = None) -> T:
        return from_args(cls, cls.ENV_PREFIX, argv, cls.PROG, cls.DESCRIPTION, cls.FLAG_HELP)
