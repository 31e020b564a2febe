"""Hypothesis strategies for JSON values, shared by the property tests of keys and schemas."""

from __future__ import annotations

from hypothesis import strategies as st

# The largest integer every JSON reader keeps exactly (an IEEE 754 double's 53-bit mantissa).
SAFE_INT = 2**53 - 1


def json_values(*, text_size: int, key_size: int, leaves: int) -> st.SearchStrategy[object]:
    """Any JSON value: scalars, and lists and objects of them, nested up to ``leaves`` leaves."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-SAFE_INT, max_value=SAFE_INT)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=text_size)
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=key_size), children, max_size=3)
        ),
        max_leaves=leaves,
    )
