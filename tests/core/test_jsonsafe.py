"""kvx_core.jsonsafe: outside JSON raises only KvxError (INVALID_ARGUMENT)."""
from __future__ import annotations

import pytest

from kvx_core import jsonsafe
from kvx_core.errors import KvxError, Status


@pytest.mark.parametrize("text", ["NaN", "[1, Infinity]", '{"a": -Infinity}', "[" * 100_000 + "]" * 100_000,
                                  '{"a": [' * 65 + "]}" * 65, "{", "", b"\xff\xfe", "[1] x"])
def test_refused(text):
    with pytest.raises(KvxError) as e:
        jsonsafe.loads(text.encode() if isinstance(text, str) else text, "the thing")
    assert e.value.status == Status.INVALID_ARGUMENT and "the thing" in e.value.message


def test_accepts_strict_json_and_brackets_in_strings():
    doc = '{"a": [1, 2.5, "[[[{{{\\"", null, true], "b": {"c": -1e300}}'
    assert jsonsafe.loads(doc, "x") == {"a": [1, 2.5, '[[[{{{"', None, True], "b": {"c": -1e300}}
    nested = "[" * jsonsafe.MAX_DEPTH + "]" * jsonsafe.MAX_DEPTH
    assert jsonsafe.loads(nested.encode(), "x") is not None


def test_loads_object():
    assert jsonsafe.loads_object(b'{"a": 1}', "x") == {"a": 1}
    with pytest.raises(KvxError, match="must be a JSON object"):
        jsonsafe.loads_object(b"[1]", "x")


@pytest.mark.parametrize("value, want", [(1, 1.0), (-2.5, -2.5), (0, 0.0), (True, None), ("1", None), (None, None),
                                         (float("nan"), None), (float("inf"), None), (10**400, None), ([1], None)])
def test_finite_number(value, want):
    assert jsonsafe.finite_number(value) == want
