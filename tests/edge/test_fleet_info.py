"""What routers ask an instance (`edge/fleet_info.py`): its load, its model and block size,
and where its KV-cache events are published; behind the key like every route but the probes.

In-process over the stub engine (tests/app_harness.py)."""

from __future__ import annotations

import pytest
from app_harness import SchedulerStats, StubEngine, call, make_app

from triode.actors.core.kv_events import kv_event_sources
from triode.edge.auth import ApiKeys

KEY = "sk-router"


@pytest.mark.parametrize("path", ["/get_load", "/get_server_info", "/kv_event_sources"])
async def test_each_needs_the_key_where_keys_are_set(path: str) -> None:
    app = make_app(api_keys=ApiKeys([KEY]))
    assert (await call(app, "GET", path)).status == 401
    assert (await call(app, "GET", path, key=KEY)).status == 200
    assert (await call(app, "POST", path, key=KEY)).status == 405


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions/render", {"prompt": "hi"}),
    ],
)
async def test_render_needs_the_key_and_its_body_is_capped(
    path: str, body: dict[str, object]
) -> None:
    app = make_app(api_keys=ApiKeys([KEY]), max_body_size=1024)
    assert (await call(app, "POST", path, body)).status == 401
    assert (await call(app, "POST", path, body, key=KEY)).status == 200
    large = {**body, "padding": "x" * 2000}
    assert (await call(app, "POST", path, large, key=KEY)).status == 413


async def test_the_load_is_the_requests_running_and_waiting() -> None:
    app = make_app()
    engine: StubEngine = app.engine  # type: ignore[assignment]
    engine.stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=4, kv_cache_usage=0.5)
    answer = await call(app, "GET", "/get_load")
    assert answer.json() == {"load": 7}


async def test_server_info_names_the_model_and_the_block_size() -> None:
    app = make_app(served_model_names=["smol", "alias"])
    info = (await call(app, "GET", "/get_server_info")).json()
    assert info["model_id"] == "smol"
    assert info["kv_block_size"] == 16
    assert info["kv_events"] is False


async def test_event_sources_are_each_ranks_endpoints_in_the_shape_routers_discover() -> None:
    app = make_app()
    assert (await call(app, "GET", "/kv_event_sources")).json() == {}
    engine: StubEngine = app.engine  # type: ignore[assignment]
    config = {"enable_kv_cache_events": True, "publisher": None, "topic": "",
              "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5567",
              "buffer_steps": 10, "hwm": 100, "max_queue_size": 100}  # fmt: skip
    engine.kv_event_sources = kv_event_sources(config, 2)
    sources = (await call(app, "GET", "/kv_event_sources")).json()
    assert sorted(sources) == ["0", "1"]
    assert [sources[r]["endpoint"] for r in "01"] == [
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    ]
    assert sources["1"]["replay_endpoint"] == "tcp://127.0.0.1:5568"
    for source in sources.values():
        assert (source["publisher"], source["encoding"], source["schema_version"]) == (
            "zmq", "msgpack", 1,
        )  # fmt: skip


async def test_render_gives_the_token_ids_a_request_would_run_as() -> None:
    """vllm-router's kv_aware asks each instance for a request's token ids before it picks one
    (`{"token_ids", "features"}` for chat, a list of them for completions)."""
    app = make_app()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "gateway": 1}
    answer = await call(app, "POST", "/v1/chat/completions/render", chat)
    assert answer.json() == {"token_ids": list(b"hi"), "features": None}
    assert answer.headers[b"triode-ignored-fields"] == b"gateway"
    prompts = {"model": "m", "prompt": ["ab", "c"]}
    answer = await call(app, "POST", "/v1/completions/render", prompts)
    assert answer.json() == [{"token_ids": list(b"ab"), "features": None},
                             {"token_ids": list(b"c"), "features": None}]  # fmt: skip
    ids = await call(app, "POST", "/v1/completions/render", {"prompt": [5, 6, 7]})
    assert ids.json() == [{"token_ids": [5, 6, 7], "features": None}]
    engine: StubEngine = app.engine  # type: ignore[assignment]
    assert engine.sampled == []  # nothing ran


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"prompt": [10**9]}, "prompt"),
        ({"model": "nope", "prompt": "x"}, "model"),
    ],
)
async def test_render_refuses_what_generation_would(body: dict[str, object], param: str) -> None:
    app = make_app()
    answer = await call(app, "POST", "/v1/completions/render", body)
    assert answer.status in (400, 404)
    assert answer.json()["error"]["param"] == param


async def test_an_x_data_parallel_rank_header_picks_the_engine_core() -> None:
    """vllm-router sends it to an instance with several engine cores (vLLM's header)."""
    app = make_app()
    engine: StubEngine = app.engine  # type: ignore[assignment]
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    headers = [(b"x-data-parallel-rank", b"1")]
    assert (await call(app, "POST", "/v1/completions", body, headers=headers)).status == 200
    assert (await call(app, "POST", "/v1/completions", body)).status == 200
    assert engine.ranks == [1, None]
    for bad in (b"-1", b"one", b"99999", b""):
        answer = await call(
            app, "POST", "/v1/completions", body, headers=[(b"x-data-parallel-rank", bad)]
        )
        assert answer.status == 400 and "X-data-parallel-rank" in answer.json()["error"]["message"]
    assert engine.ranks == [1, None]
