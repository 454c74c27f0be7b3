"""Property-based fuzz of the API from its own OpenAPI schema (schemathesis's strategies, driven by
hypothesis) against the real stack over HTTP: no input, valid or not, may get a 500 or hang.

Bounded: a fixed number of examples per operation and mode, and a 20 s timeout per request (a
hang fails). The fuzzing user's quota allows no running job, so every valid job or batch it
generates is refused at admission and nothing reaches the worker. Left out: the never-ending SSE
streams (/api/events; the job and selection streams answer 404 for this user, who owns nothing)
and the revocation of the fuzzer's own token (which would only turn the rest into 401s).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.conftest import StackHandle

pytestmark = pytest.mark.integration

EXAMPLES = 12
"""Per operation and mode (valid inputs, invalid inputs): about 600 requests in all."""


def test_no_input_gets_a_500_or_hangs(stack: StackHandle) -> None:
    resp = stack.client.post("/api/users", json={"name": "fuzzer", "max_running_jobs": 0})
    assert resp.status_code == 201, resp.text
    auth = {"Authorization": f"Bearer {resp.json()['token']}"}
    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json", timeout=30)
    # the fuzzer's own token must outlive the fuzz: no revoking tokens, its own or all of its user's
    schema = schema.exclude(path_regex=r"^/api/events$|/stream$").exclude(
        method="DELETE", path_regex=r"^/api/tokens/|^/api/users/[^/]+/tokens$"
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]
    seen: list[int] = []
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(op, mode, base_url=stack.base_url, headers=auth, seen=seen)
            except Unsatisfiable:
                # an operation with no parameters and no body has no invalid input to make
                assert mode == GenerationMode.NEGATIVE, op.label

    # the fuzz reached the routes, not only the validation in front of them
    codes = set(seen)
    assert {200, 404, 422} <= codes, sorted(codes)


def _fuzz(op, mode: GenerationMode, *, base_url: str, headers: dict, seen: list[int]) -> None:  # noqa: ANN001
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def call(case) -> None:  # noqa: ANN001 - schemathesis's Case
        # requests raises on the timeout: a hang fails the test too
        r = case.call(base_url=base_url, headers=headers, timeout=20)
        seen.append(r.status_code)
        assert r.status_code < 500, f"{case.method} {case.formatted_path}: {r.status_code} {r.text[:300]}"

    call()
