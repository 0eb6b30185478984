"""Throwaway certificates for the TLS tests (ragcore.security.make_certs: a CA, a server certificate for localhost
and 127.0.0.1, a client certificate), shared by every test that puts TLS between two real services.

    from tests.tls import certs, needs_openssl  # noqa: F401  (pytest fixture)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ragcore.security import make_certs

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    return make_certs(tmp_path_factory.mktemp("certs"), ["localhost", "127.0.0.1"])
