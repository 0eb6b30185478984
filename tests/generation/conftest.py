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


@pytest.fixture(scope="session")
def tmq4():
    """The q4_1 weight format (the shipped GGUF's blocks; model/q4_weights.py)."""
    return real_model("q4_1")


@pytest.fixture(scope="session")
def tmq4bf16():
    """q4_1's blocks with bf16 activations (AMX tiles or AVX512-BF16; skipped where the CPU has neither)."""
    from generation_service.model.kernels.build import kernel

    if kernel() is None or not kernel().bf16():
        pytest.skip("no AMX tiles or AVX512-BF16 on this CPU")
    return real_model("q4_1_bf16")


@pytest.fixture(scope="session")
def tmq4i8():
    """q4_1's blocks with int8 activations (int8_linear.cpp; every CPU the kernels build on)."""
    from generation_service.model.kernels.build import kernel

    if kernel() is None or not hasattr(kernel(), "i8_linear"):
        pytest.skip("the CPU kernels are not built here")
    return real_model("q4_1_i8")
