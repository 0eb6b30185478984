"""Fixtures for the generation core: the real model (fp32 for identity, bf16 for the serving dtype) and
reference runs. Tests that need the model are marked `model` and skip when it is not prepared."""

from __future__ import annotations

import pytest

from generation_service.model_files import default_model_dir, is_model_dir


def _model_or_skip(dtype: str):
    if not is_model_dir(default_model_dir()):
        pytest.skip(f"default model not prepared at {default_model_dir()} (make model)")
    from generation_service.model import load_model

    return load_model("", dtype=dtype, device="cpu")


@pytest.fixture(scope="session")
def tm32():
    return _model_or_skip("fp32")


@pytest.fixture(scope="session")
def tm16():
    return _model_or_skip("bf16")
