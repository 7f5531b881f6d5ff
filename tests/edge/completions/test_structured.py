"""The edge's reading of structured output requests: every way to ask for one, and a 400 naming
the field for every bad one, before anything reaches the engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from triode.edge.completions.request_bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
)
from triode.edge.completions.structured import (
    check_structured,
    structured_from_text_format,
    structured_outputs_of,
)
from triode.edge.errors import APIError
from triode.wire import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
TEXT = json.dumps(SCHEMA)


def _js(**spec: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


def _completion(**fields: Any) -> CompletionRequest:
    return decode_request(json.dumps({"prompt": "hi", **fields}).encode(), CompletionRequest)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("response_format", SO(json_object=True))),
        (
            _js(name="x", schema=SCHEMA),
            ("response_format", SO(json=TEXT)),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, ("structured_outputs", SO(regex="[a-z]+"))),
        (
            {"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True}},
            ("structured_outputs", SO(choice=["a", "b"])),
        ),
        ({"structured_outputs": {"json": TEXT}}, ("structured_outputs", SO(json=TEXT))),
        ({"guided_json": SCHEMA}, ("guided_json", SO(json=json.dumps(SCHEMA)))),
        (
            {"guided_choice": ["x"], "guided_decoding_backend": "xgrammar"},
            ("guided_choice", SO(choice=["x"])),
        ),
        ({"guided_grammar": 'root ::= "a"'}, ("guided_grammar", SO(grammar='root ::= "a"'))),
        ({"guided_regex": "a|b"}, ("guided_regex", SO(regex="a|b"))),
    ],
)  # fmt: skip
def test_every_way_to_ask(fields: dict[str, Any], expected: Any) -> None:
    assert structured_outputs_of(_chat(**fields)) == expected
    assert structured_outputs_of(_completion(**fields)) == expected


def test_a_schema_keeps_its_property_order() -> None:
    # properties are generated in the order given: the key order is the user's
    found = structured_outputs_of(_chat(guided_json=SCHEMA))
    assert found is not None and list(json.loads(found[1].json or "")["properties"]) == ["b", "a"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (_js(schema={}), "response_format.json_schema.name"),
        (_js(name="x", schema=[1]), "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"nonsense": 1}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x", "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)  # fmt: skip
def test_malformed_requests_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        structured_outputs_of(_chat(**fields))
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize(
    "so",
    [
        SO(json='{"type": "nope"}'),
        SO(json='{"properties": {"a": {"$ref": "#/$defs/missing"}}}'),
        SO(regex="(("),
        SO(grammar="start: missing"),
        SO(grammar="root ::= ("),
        SO(json=json.dumps({"type": "string", "pattern": "x" * 5000 + "(["})),  # in a thread
    ],
)
async def test_constraints_that_do_not_compile_are_400s(so: SO) -> None:
    with pytest.raises(APIError) as caught:
        await check_structured(so, param="structured_outputs")
    assert caught.value.status == 400 and caught.value.param == "structured_outputs"
    assert caught.value.message.startswith("structured_outputs: ")


async def test_constraints_that_compile_pass() -> None:
    for so in (SO(json=json.dumps(SCHEMA)), SO(choice=["a"]), SO(grammar='start: "a"+')):
        await check_structured(so, param="x")
    await trio.lowlevel.checkpoint()


def test_text_format_of_the_responses_api() -> None:
    fmt = {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}
    assert structured_from_text_format(fmt, param="text.format") == SO(json=json.dumps(SCHEMA))
    assert structured_from_text_format({"type": "text"}, param="text.format") is None
    assert structured_from_text_format({"type": "json_object"}, param="f") == SO(json_object=True)
    for bad in ({"type": "yaml"}, {"type": "json_schema", "schema": SCHEMA, "extra": 1}, "x"):
        with pytest.raises(APIError) as caught:
            structured_from_text_format(bad, param="text.format")
        assert caught.value.param == "text.format"
