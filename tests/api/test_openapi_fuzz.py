"""Schemathesis against the service's own OpenAPI schema, in process on the CPU backend.

Every operation gets a bounded number of generated requests (valid ones and, where the schema allows,
invalid ones); each answer must not be a 5xx and must be what the schema documents for that operation: a
listed status, its media type, a body of its schema.
"""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.codecs import NPZ_MEDIA_TYPE
from app.config import Settings
from app.main import create_app
from tests.codecs.test_codec_properties import mutated, valid_npz

APP = create_app(Settings(backend="cpu", access_log=False))
schema = schemathesis.openapi.from_dict(APP.openapi())
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Schemathesis has no generator of .npz bodies: archives of a and b, whole or broken.
schemathesis.openapi.media_type(NPZ_MEDIA_TYPE, valid_npz | mutated(valid_npz))


@pytest.fixture(autouse=True)
def ready_app() -> None:
    """Schemathesis runs the app's lifespan from a test's first request to the test's end: make that first
    request here, until the engine is ready, so that no generated case meets the 503 of a service starting."""
    readyz = schema["/readyz"]["GET"]
    for _ in range(600):
        if readyz.Case().call(app=APP).status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the app never became ready")


@schema.parametrize()
@settings(max_examples=25)
def test_every_operation_answers_as_documented(case: schemathesis.Case) -> None:
    case.call_and_validate(app=APP, checks=CHECKS)
