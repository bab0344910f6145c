"""Abort by request id: which in-flight generation RPCs an Abort call may end.

A router that holds a stream on one call and decides on another (its own client went away, a
hedged request won elsewhere) names the request by the id it gave it. Ids are the caller's and not
unique (engine/client/engine_client.py), so a request is found by (caller, id): an Abort call ends
the requests of its own caller, every one of them under that id, and never learns of anyone else's.

The caller is its bearer token when the server requires one (`--auth-token-file`): the same token
on any connection or process, and no other token, reaches the request. Without tokens every caller
is the one anonymous caller, as in vLLM (its engine aborts by request id) and SGLang
(`/abort_request` ends the request it names for whoever asks): an Abort from another process, such
as `pie-client abort ID` beside the client that streams, ends the request it names. A server open
to callers who must not end each other's requests gives each a token.
"""

from __future__ import annotations

import hashlib

import grpc

from pie.engine.client.engine_client import EngineClient, RequestStream

ANONYMOUS = "anonymous"  # every caller of a server without bearer tokens


def caller_of(context: grpc.aio.ServicerContext, auth: bool) -> str:
    """The caller of an RPC: a digest of its bearer token (the auth interceptor accepted it
    before the call got here), or the anonymous caller."""
    if auth:
        header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
        token = header.removeprefix("Bearer ").strip() if isinstance(header, str) else ""
        return "token:" + hashlib.sha256(token.encode()).hexdigest()
    return ANONYMOUS


class InFlight:
    """The in-flight generation requests by caller and request id: added once the engine holds
    them, removed when their RPC ends however it ends."""

    def __init__(self) -> None:
        # caller -> request id -> (engine client, stream) of each of its requests under that id
        self._by_caller: dict[str, dict[str, list[tuple[EngineClient, RequestStream]]]] = {}

    def add(self, caller: str, client: EngineClient, stream: RequestStream) -> None:
        self._by_caller.setdefault(caller, {}).setdefault(stream.caller_id, []).append((client, stream))

    def remove(self, caller: str, stream: RequestStream) -> None:
        ids = self._by_caller.get(caller)
        entries = ids.get(stream.caller_id) if ids is not None else None
        if ids is None or entries is None:
            return
        entries[:] = [e for e in entries if e[1] is not stream]
        if not entries:
            del ids[stream.caller_id]
            if not ids:
                del self._by_caller[caller]

    def abort(self, caller: str, request_ids: list[str]) -> list[str]:
        """Aborts every unfinished request of `caller` under each id (the engine frees it within one
        step, its RPC ends with CANCELLED); returns the ids that named at least one, in order."""
        ids = self._by_caller.get(caller, {})
        found = []
        for rid in dict.fromkeys(request_ids):
            hit = False
            for client, stream in ids.get(rid, ()):
                if stream.finished or stream.cancelled:  # done already: its RPC is answering
                    continue
                client.abort(stream)
                stream.cancel()
                hit = True
            if hit:
                found.append(rid)
        return found

    def __len__(self) -> int:
        """Requests tracked (all callers)."""
        return sum(len(entries) for ids in self._by_caller.values() for entries in ids.values())
