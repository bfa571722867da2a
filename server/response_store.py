"""The Responses API's stored responses: what `previous_response_id` and `GET/DELETE
/v1/responses/{id}` read. In memory and bounded (`server.stored_responses`), least recently used
first out; a restart forgets them, as documented in README.md."""

from __future__ import annotations

import collections
from typing import Optional

from .errors import APIError


class ResponseStore:
    """Stored responses (`store` true, the default), least recently used dropped past capacity."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.capacity == 0:
            return
        self._items[response["id"]] = {"response": response, "conversation": conversation}
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

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
        del self._items[response_id]
