"""docs/API_FIELDS.md lists exactly the fields each route's validator knows: a field added to (or
dropped from) a validator without its row fails here, so the table cannot drift."""

import re
from pathlib import Path

import pytest

from hebrus_mlx.serve import anthropic_api, api_fields, responses_api

DOC = (Path(__file__).resolve().parents[1] / "docs" / "API_FIELDS.md").read_text()
ROUTES = {
    "POST /v1/chat/completions": api_fields.CHAT_FIELDS,
    "POST /v1/completions": api_fields.COMPLETION_FIELDS,
    "POST /v1/responses": responses_api.RESPONSES_FIELDS,
    "POST /v1/responses/input_tokens": responses_api.INPUT_TOKENS_FIELDS,
    "GET /v1/responses/{id}/input_items": responses_api.LIST_QUERY,
    "POST /v1/messages": anthropic_api.MESSAGES_FIELDS,
    "POST /v1/messages/count_tokens": anthropic_api.COUNT_TOKENS_FIELDS,
}
STATES = {"honoured", "no-op", "default only"}


def _tables():
    """{route: [(field, state)]} from each `### \\`METHOD /path\\`` section's table."""
    out = {}
    main = DOC.split("\n## Pending")[0]
    for section in re.split(r"\n### ", main)[1:]:
        route = re.match(r"`([^`]+)`", section).group(1)
        out[route] = re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", section, re.M)
    return out


@pytest.mark.parametrize("route", ROUTES)
def test_each_table_lists_exactly_the_validators_fields(route):
    rows = _tables()[route]
    fields = [f for f, _ in rows]
    assert len(fields) == len(set(fields)), f"{route}: a field listed twice"
    assert set(fields) == set(ROUTES[route]), f"{route}: {set(fields) ^ set(ROUTES[route])}"
    assert {s for _, s in rows} <= STATES


def test_every_route_section_is_checked():
    assert set(_tables()) == set(ROUTES)
