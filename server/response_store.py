"""The Responses API's stored responses: what `previous_response_id` and `GET/DELETE
/v1/responses/{id}` read. In memory and bounded in count (`server.stored_responses`) and in size
(`server.stored_responses_mb`, their JSON), least recently used first out; a restart forgets them,
as documented in README.md."""

from __future__ import annotations

import collections
import json
from typing import Optional

from .errors import APIError


class ResponseStore:
    """Stored responses (`store` true, the default), least recently used dropped past capacity."""

    def __init__(self, capacity: int, max_bytes: Optional[int] = None):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self.bytes = 0  # the stored entries' sizes (their JSON; a chain's shared history counted per entry)

    def put(self, response: dict, conversation: list[dict]) -> None:
        """Store a response and its conversation. The size bound matters where the count does not:
        a conversation may carry text the prompt leaves out (earlier reasoning), which no context
        limit bounds: 24 requests of 12 MB of reasoning each held 560 MB."""
        if self.capacity == 0:
            return
        size = len(json.dumps(conversation)) + len(json.dumps(response))  # (ASCII JSON: characters are bytes)
        if self.max_bytes is not None and size > self.max_bytes:
            return  # larger than the whole store: not kept (a later previous_response_id to it is a 400)
        if response["id"] in self._items:
            self.bytes -= self._items.pop(response["id"])["bytes"]
        self._items[response["id"]] = {"response": response, "conversation": conversation, "bytes": size}
        self.bytes += size
        while len(self._items) > self.capacity or (self.max_bytes is not None and self.bytes > self.max_bytes):
            self.bytes -= self._items.popitem(last=False)[1]["bytes"]

    def get(self, response_id: str, param: Optional[str] = None) -> dict:
        entry = self._items.get(response_id)
        if entry is None:
            status = 400 if param else 404
            raise APIError(status, f"No response found with id {response_id!r}", param=param,
                           type="invalid_request_error" if param else "not_found_error",
                           code="previous_response_not_found" if param else "not_found")
        self._items.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self.bytes -= self._items.pop(response_id)["bytes"]
