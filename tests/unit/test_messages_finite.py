"""A protocol line's data with NaN or infinite numbers (a run stopped before its first step reports
a NaN final loss) parses into data every database stores: PostgreSQL refuses NaN in json."""

from __future__ import annotations

import json

from core.messages import parse_line


def test_non_finite_numbers_in_a_result_become_null() -> None:
    line = '{"seq": 3, "kind": "result", "data": {"final_loss": NaN, "steps": 0, "rates": [1.5, Infinity]}}'
    msg = parse_line(line)
    assert msg is not None and msg.kind == "result"
    assert msg.data == {"final_loss": None, "steps": 0, "rates": [1.5, None]}
    json.dumps(msg.data, allow_nan=False)  # what a strict JSON column takes
    ev = parse_line('{"seq": 4, "kind": "event", "event": "eval", "data": {"val_loss": -Infinity}}')
    assert ev is not None and ev.data == {"val_loss": None}
