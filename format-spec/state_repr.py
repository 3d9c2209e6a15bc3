"""The text of a decoded state in the vectors' ``expected.repr`` and ``expected.metadata`` fields
(vectors/vectors.json, kind ``state``): Python's repr as 3.11 writes it, on any Python. 3.12
changed how an OrderedDict prints (``OrderedDict({'a': 1})`` for ``OrderedDict([('a', 1)])``);
the vectors keep one form, so the generator (make_vectors.py) and the test that reads them
(tests/test_format_vectors.py) render through this one function."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def state_repr(x: Any) -> str:
    """``repr(x)``, with every OrderedDict inside written as ``OrderedDict([(k, v), ...])``
    (``OrderedDict()`` when empty); dicts, lists and tuples are walked, anything else is its own
    repr."""
    if type(x) is OrderedDict:
        if not x:
            return "OrderedDict()"
        return "OrderedDict([" + ", ".join(f"({state_repr(k)}, {state_repr(v)})"
                                           for k, v in x.items()) + "])"
    if type(x) is dict:
        return "{" + ", ".join(f"{state_repr(k)}: {state_repr(v)}" for k, v in x.items()) + "}"
    if type(x) is list:
        return "[" + ", ".join(state_repr(v) for v in x) + "]"
    if type(x) is tuple:
        return "(" + ", ".join(state_repr(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    return repr(x)
