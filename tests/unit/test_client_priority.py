"""The suite's client priority (tests/conftest.py) reads the kernel's autogroup file as it comes."""

from __future__ import annotations

import pytest

from tests.conftest import autogroup_nice


@pytest.mark.parametrize(("text", "nice"), [
    ("/autogroup-176 nice 0\n", 0),
    ("/autogroup-9 nice -10\n", -10),
    ("/autogroup-9 nice 19", 19),
    ("", None),  # the kernel's default group (CI): no session group whose nice could be set
])
def test_autogroup_file_is_read_as_the_kernel_writes_it(text: str, nice: int | None) -> None:
    assert autogroup_nice(text) == nice
