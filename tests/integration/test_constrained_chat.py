"""Structured output and tool calling through `triode serve` on the real default model, driven
by the `openai` client: constrained answers parse and validate on many prompts and seeds,
streamed or not, and bad constraints are 400s that leave the engine untouched."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from conftest import API_KEYS, SERVED_NAME
from server import Server

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Rome", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person as JSON.",
    "Who lives in the city? Answer in JSON.",
    "Invent a character for a novel.",
    "Give me a user profile.",
]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/api/v1", api_key=API_KEYS[0], max_retries=0)


def _idle(server: Server, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        values = {
            line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("triode:") and "{" in line
        }
        if values["triode:num_requests_running"] == 0 and values["triode:kv_cache_usage_perc"] == 0:
            return True
        time.sleep(0.1)
    return False


def test_json_schema_answers_validate_across_prompts_and_seeds(server: Server) -> None:
    client = _client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(prompt: str, seed: int | None) -> None:
        answer = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=120,
            temperature=0 if seed is None else 1.0,
            seed=seed,
            response_format=fmt,  # type: ignore[arg-type]
        )
        [choice] = answer.choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)

    # concurrently, so the constrained rows share batches (and their masks one step)
    with ThreadPoolExecutor(8) as pool:
        asks = [(p, seed) for i, p in enumerate(PROMPTS) for seed in (None, 11 * i + 1)]
        for done in [pool.submit(ask, p, seed) for p, seed in asks]:
            done.result()


def test_a_streamed_constrained_answer_reassembles_to_the_whole_one(server: Server) -> None:
    client = _client(server)
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 120,
        "temperature": 0,
        "extra_body": {"guided_json": PERSON},
    }
    whole = client.chat.completions.create(**body).choices[0].message.content  # type: ignore[call-overload]
    chunks = client.chat.completions.create(stream=True, **body)  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


def test_choice_regex_and_grammar_in_completions(server: Server) -> None:
    client = _client(server)
    cities = ["Paris", "Lyon", "Marseille"]
    cases = [
        ({"guided_choice": cities}, lambda t: t in cities),
        ({"structured_outputs": {"regex": r"[0-9]{4}"}}, lambda t: len(t) == 4 and t.isdigit()),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]  # fmt: skip
    for extra, check in cases:
        answer = client.completions.create(
            model=SERVED_NAME,
            prompt="The capital of France is",
            max_tokens=12,
            temperature=0,
            extra_body=extra,
        )
        text = answer.choices[0].text
        assert check(text), (extra, text)
        assert answer.choices[0].finish_reason == "stop"


def test_bad_constraints_are_400s_before_the_engine(server: Server) -> None:
    client = _client(server)
    nope = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    bad = [
        ({"response_format": nope}, "response_format"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=SERVED_NAME,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_body=extra,
            )
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]
    assert _idle(server)
