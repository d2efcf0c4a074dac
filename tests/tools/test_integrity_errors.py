"""How the integrity load's tritonclient ways name a failure: a connection that ended mid-answer is a closed
connection (which a load that kills workers expects), anything else the HTTP parser refuses fails the load, and
either comes back from a client process (the parser's own exceptions do not pickle)."""

from __future__ import annotations

import pickle

import pytest
from geventhttpclient.response import HTTPConnectionClosed, HTTPParseError

from matmul_tools.integrity import Closed, _triton_errors


@pytest.mark.parametrize(
    "raised",
    [
        HTTPParseError("Incomplete response."),  # the server's process died while it sent the answer
        HTTPConnectionClosed("connection closed."),
        HTTPParseError("connection closed before end of the headers"),
    ],
)
def test_an_answer_cut_short_by_the_connections_end_is_a_closed_connection(raised: HTTPParseError) -> None:
    with pytest.raises(Closed) as caught, _triton_errors():
        raise raised
    assert pickle.loads(pickle.dumps(caught.value)).args == (str(raised),)


def test_a_malformed_answer_fails_the_load_with_an_error_a_client_process_can_hand_back() -> None:
    with pytest.raises(RuntimeError, match="refused an answer: invalid HTTP status code") as caught, _triton_errors():
        raise HTTPParseError("invalid HTTP status code")
    assert pickle.loads(pickle.dumps(caught.value)).args == caught.value.args
