"""Fixtures for the generation core: the real model (fp32 for identity, bf16 for the serving dtype) and
reference runs. Tests that need the model are marked `model` and skip when it is not prepared."""

from __future__ import annotations

import pytest

from tests.conftest import real_model


@pytest.fixture(scope="session")
def tm32():
    return real_model("fp32")


@pytest.fixture(scope="session")
def tm16(tm):
    return tm  # the shared bf16 model (tests/conftest.py)
