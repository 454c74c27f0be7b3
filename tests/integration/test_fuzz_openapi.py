"""Property-based fuzz of the API from its own OpenAPI schema (schemathesis, on hypothesis) against
the real stack over HTTP: no input may get a 500 or hang.

The fuzzing user's quota allows no running job, so every valid job or batch it generates is
refused at admission and nothing reaches the worker. Left out: the never-ending SSE streams
(/api/events; the job and selection streams answer 404 for this user, who owns nothing) and the
revocation of the fuzzer's own token (which would only turn the rest into 401s).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error

from tests.conftest import StackHandle

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fuzz_token(stack: StackHandle) -> str:
    resp = stack.client.post("/api/users", json={"name": "fuzzer", "max_running_jobs": 0})
    assert resp.status_code == 201, resp.text
    return resp.json()["token"]


@pytest.fixture(scope="module")
def api_schema(stack: StackHandle, fuzz_token: str):  # noqa: ANN201 - schemathesis's schema object
    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json", timeout=30)
    return schema.exclude(path_regex=r"^/api/events$|/stream$").exclude(
        method="DELETE", path="/api/tokens/{token_id}"
    )


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=30,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_input_gets_a_500_or_hangs(case, stack: StackHandle, fuzz_token: str) -> None:  # noqa: ANN001
    # a request that hangs fails on the timeout (requests raises)
    case.call_and_validate(
        base_url=stack.base_url,
        headers={"Authorization": f"Bearer {fuzz_token}"},
        checks=[not_a_server_error],
        timeout=20,
    )
