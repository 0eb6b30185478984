"""`--help` of both servers: every flag has a one-line description, its default and its environment variable."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys

import pytest

from gateway.config import FLAG_HELP as GW_HELP, GatewayConfig
from generation_service.config import FLAG_HELP as GEN_HELP, GenerationConfig
from ragcore import config_util
from retrieval_service.config import FLAG_HELP as RET_HELP, RetrievalConfig

# (server module, config class, description table, env prefix)
SERVERS = [
    ("retrieval_service.server", RetrievalConfig, RET_HELP, "RAGSERVE_RETRIEVAL_"),
    ("generation_service.server", GenerationConfig, GEN_HELP, "RAGSERVE_GENERATION_"),
    ("gateway.server", GatewayConfig, GW_HELP, "RAGSERVE_GATEWAY_"),
]


@pytest.mark.parametrize("module,cls,table,prefix", SERVERS, ids=[s[0] for s in SERVERS])
def test_every_field_is_described(module, cls, table, prefix):
    assert config_util.missing_help(cls, table) == []  # Not a flag that --help leaves unexplained
    for name, text in table.items():
        assert "\n" not in text and len(text) <= 160, name  # one line


@pytest.mark.parametrize("module,cls,table,prefix", SERVERS, ids=[s[0] for s in SERVERS])
def test_help_lists_flag_default_and_env(module, cls, table, prefix):
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefix)}
    env["COLUMNS"] = "400"  # one flag per line: argparse wraps at the terminal width
    env[prefix + "PORT"] = "4321"
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^\s+--([a-z0-9-]+) [A-Z]+\s+(.*)$", out.stdout, re.M)}
    for f in dataclasses.fields(cls):
        flag = f.name.replace("_", "-")
        assert flag in lines, f"--{flag} missing from --help"
        line = lines[flag]
        assert line.startswith(table[f.name].split(" ")[0]), line  # the description, not a bare metavar
        assert f"env {prefix}{f.name.upper()}]" in line, line
        if f.name == "port":
            assert "[default 4321 (from the environment);" in line, line  # the effective default
        else:
            shown = '""' if f.default == "" else str(f.default)
            assert f"[default {shown};" in line, line
    assert "(undocumented)" not in out.stdout


# (flag value, the root logger's level after configure_logging or the error naming the field)
LOG_LEVEL_CASES = [
    ("debug", 10, None),
    ("info", 20, None),
    ("error", 40, None),
    ("INFO", None, "log_level"),  # the flags are lower case, like every other choice
    ("loud", None, "log_level"),
]


@pytest.mark.parametrize("module,cls,table,prefix", SERVERS, ids=[s[0] for s in SERVERS])
@pytest.mark.parametrize("value,level,error", LOG_LEVEL_CASES, ids=[c[0] for c in LOG_LEVEL_CASES])
def test_log_level(module, cls, table, prefix, value, level, error, monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # basicConfig only configures a root logger without handlers
    monkeypatch.setattr(root, "level", root.level)
    cfg = cls.from_args(["--log-level", value])
    if error:
        with pytest.raises(ValueError, match=error):
            cfg.configure_logging()
        return
    cfg.configure_logging()
    assert root.level == level  # Not Python's default (WARNING) left in place
