"""What a rank's keeper and its node say to each other about just-in-time state.

Each attached rank serves a few requests on a Unix socket of its own, from a thread, so it
answers while its main thread sits in a collective that will never finish
(``rank/keeper.py``). The node asks (``node/last_step.py``). Plain HTTP/1.0 with JSON
bodies, the standard library's server on one side and ``http.client`` on the other, as torch's
own control-plane worker server does (``torch.distributed.elastic.control_plane``: the same
idea, but a private API that logs two C++ warnings per rank and starts only when the script is
wrapped in ``worker_main``).

The socket is in Linux's abstract namespace (no file, no path-length limit, gone with the
process), named by the run's token, the attempt and the rank. Every request carries the token
in ``X-Babysit-Token``, so another process of the machine cannot ask for anything.

=============================  ==============================================================
``GET /state``                 the rank's view: consistent or why not, the step, cursor and
                               LR scale its state is of, which shard of the state it holds
                               (``checkpoints.just_in_time.RankView``)
``POST /write``                ``{"dir", "step", "model"}``: write its part into ``dir``
                               (with ``model``: the model and optimizer it holds) if its
                               state is still of ``step``; answers the files written, or why not
``POST /release``              the node is done with it: a rank holding on at its end (an
                               uncaught exception, a SIGTERM) ends now, as it would have
                               without babysit; one blocked elsewhere ends by SIGTERM
=============================  ==============================================================
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

TOKEN_HEADER = "X-Babysit-Token"
STATE, WRITE, RELEASE = "/state", "/write", "/release"


def address(token_hex: str, attempt: int, rank: int) -> str:
    """The abstract socket of ``rank`` in ``attempt`` (the leading NUL makes it abstract)."""
    return f"\0babysit-{token_hex[:16]}-{attempt}-{rank}"


class Unanswered(Exception):
    """A rank did not answer: gone, not listening, or not within the time given."""


class _Connection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def ask(path: str, token_hex: str, request: str, body: dict[str, Any] | None = None, *,
        timeout: float) -> dict[str, Any]:
    """Send ``request`` (one of the paths above) to the keeper at ``path``; its JSON answer.
    Raises ``Unanswered`` when it does not answer within ``timeout`` seconds."""
    conn = _Connection(path, timeout)
    try:
        data = json.dumps(body or {}).encode()
        conn.request("GET" if request == STATE else "POST", request, body=data,
                     headers={TOKEN_HEADER: token_hex, "Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read() or b"{}")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise Unanswered(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) \
            from exc
    finally:
        conn.close()
    if response.status != 200 or not isinstance(answer, dict):
        raise Unanswered(f"HTTP {response.status}: {answer}")
    return answer
