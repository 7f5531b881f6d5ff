"""The administrative routes (edge/admin.py): served only with `--enable-admin-api`, behind the
API key, their query strings and bodies bounded and checked before the engine hears of them,
and the engine's refusals answered as 400 or 409.

The app's own decisions run in-process over an engine whose `EngineAdmin` talks to a recorder
instead of engine cores; what the real engine does with the calls, over real servers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from app_harness import Answer, StubEngine, call
from integration.server import Server, running_servers
from processes import alive

from triode.actors import EngineAdmin, EngineDeadError, OperationError
from triode.edge.admin import (
    ADMIN_ROUTES,
    MAX_QUERY_BYTES,
    MAX_QUERY_FIELDS,
    WEIGHT_VERSION_TIMEOUT,
    Query,
)
from triode.edge.app import App
from triode.edge.auth import ApiKeys, requires_auth
from triode.edge.errors import APIError
from triode.edge.settings import Settings

KEY = "admin-key"
ADMIN_CALLS = [(path, method) for path, methods in ADMIN_ROUTES.items() for method in methods]
BODIES = {
    "/update_weights_from_disk": {"model_path": "/models/next"},
    "/init_weight_transfer_engine": {"init_info": {"backend": "shm"}},
    "/update_weights": {"update_info": {"names": ["w"]}},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/adapters/a"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}


@dataclass
class Recorder:
    """Stands for the engine cores behind `EngineAdmin`: notes each call, answers with
    `answers[method]`, or raises `raises` when it is set."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)
    answers: dict[str, Any] = field(default_factory=dict)
    raises: BaseException | None = None

    async def __call__(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, *args))
        if self.raises is not None:
            raise self.raises
        return [self.answers.get(method, {"done": method})]


@dataclass
class AdminEngine(StubEngine):
    recorder: Recorder = field(default_factory=Recorder)
    tensor_parallel_size: int = 2
    pipeline_parallel_size: int = 3
    data_parallel_size: int = 4

    def __post_init__(self) -> None:
        self.admin = EngineAdmin(self.recorder)


def _app(*, enabled: bool = True, keys: tuple[str, ...] = (KEY,), **settings: Any) -> App:
    engine = AdminEngine()
    config = Settings(
        served_model_names=["m"], api_keys=ApiKeys(keys), enable_admin_api=enabled, **settings
    )
    return App(engine, config)  # type: ignore[arg-type]


def _recorder(app: App) -> Recorder:
    return app.engine.recorder  # type: ignore[attr-defined,no-any-return]


async def _call(
    app: App,
    method: str,
    path: str,
    query: bytes = b"",
    body: Any = None,
    *,
    key: str | None = KEY,
) -> Answer:
    """One request through `app`, with a query string."""
    return await call(app, method, path, body, key=key, query=query)


def _error(answer: Answer) -> dict[str, Any]:
    error: dict[str, Any] = answer.json()["error"]
    return error


# Who reaches the routes


@pytest.mark.parametrize(("path", "method"), ADMIN_CALLS)
async def test_without_the_flag_an_admin_path_is_a_404_like_an_unknown_one(
    path: str, method: str
) -> None:
    app = _app(enabled=False)
    answer = await _call(app, method, path, body=BODIES.get(path))
    unknown = await _call(app, method, "/no_such_route", body=BODIES.get(path))
    assert answer.status == unknown.status == 404
    assert _error(answer) == {**_error(unknown), "message": f"no route for {path}"}
    assert _recorder(app).calls == []
    options = await _call(app, "OPTIONS", path, key=None)
    assert options.status == 404


@pytest.mark.parametrize(("path", "method"), ADMIN_CALLS)
async def test_with_keys_an_admin_path_needs_one(path: str, method: str) -> None:
    app = _app()
    for key in (None, "wrong-key"):
        answer = await _call(app, method, path, body=BODIES.get(path), key=key)
        assert answer.status == 401
        assert answer.headers[b"www-authenticate"] == b"Bearer"
    assert _recorder(app).calls == []
    # never an open path, whatever else the settings open
    assert requires_auth(method, path, app._open_paths)
    answer = await _call(app, method, path, body=BODIES.get(path))
    assert answer.status == 200, answer.body


async def test_without_keys_the_admin_routes_are_open() -> None:
    app = _app(keys=())
    _recorder(app).answers["is_paused"] = True
    answer = await _call(app, "GET", "/is_paused", key=None)
    assert answer.status == 200 and answer.json() == {"is_paused": True}


async def test_a_wrong_method_is_a_405_naming_the_one_served() -> None:
    answer = await _call(_app(), "GET", "/sleep")
    assert answer.status == 405
    assert answer.headers[b"allow"] == b"OPTIONS, POST"


# What reaches the engine


@pytest.mark.parametrize(
    ("method", "path", "query", "called"),
    [
        ("POST", "/sleep", b"", ("sleep", 1, None)),
        ("POST", "/sleep", b"level=0", ("sleep", 0, None)),
        ("POST", "/sleep", b"level=2&tags=weights", ("sleep", 2, ["weights"])),
        ("POST", "/sleep", b"tags=kv_cache&tags=weights&tags=kv_cache",
         ("sleep", 1, ["kv_cache", "weights"])),
        ("POST", "/wake_up", b"", ("wake_up", None)),
        ("POST", "/wake_up", b"tags=weights", ("wake_up", ["weights"])),
        ("POST", "/pause", b"", ("pause", "abort")),
        ("POST", "/pause", b"mode=wait", ("pause", "wait")),
        ("POST", "/pause", b"mode=keep", ("pause", "keep")),
        ("POST", "/resume", b"", ("resume",)),
        ("POST", "/start_profile", b"", ("start_profile",)),
        ("POST", "/stop_profile", b"", ("stop_profile",)),
        ("POST", "/start_weight_update", b"", ("start_weight_update",)),
        ("POST", "/finish_weight_update", b"", ("finish_weight_update",)),
    ],
)  # fmt: skip
async def test_query_arguments_reach_the_engine_and_its_answer_comes_back(
    method: str, path: str, query: bytes, called: tuple[Any, ...]
) -> None:
    app = _app()
    answer = await _call(app, method, path, query)
    assert answer.status == 200, answer.body
    assert _recorder(app).calls == [called]
    assert answer.json() == {"done": called[0]}


@pytest.mark.parametrize(
    ("path", "body", "called"),
    [
        ("/update_weights_from_disk", {"model_path": "/m/v2"},
         ("update_weights_from_disk", "/m/v2")),
        ("/init_weight_transfer_engine", {"init_info": {"backend": "broadcast", "world_size": 2}},
         ("init_weight_transfer_engine", {"backend": "broadcast", "world_size": 2})),
        ("/update_weights", {"update_info": {"names": ["a"], "dtypes": ["float32"]}},
         ("update_weights", {"names": ["a"], "dtypes": ["float32"]})),
    ],
)  # fmt: skip
async def test_body_arguments_reach_the_engine(
    path: str, body: dict[str, Any], called: tuple[Any, ...]
) -> None:
    app = _app()
    answer = await _call(app, "POST", path, body=body)
    assert answer.status == 200, answer.body
    assert _recorder(app).calls == [called]


async def test_state_questions_answer_with_a_named_bool() -> None:
    app = _app()
    _recorder(app).answers.update(is_sleeping=False, is_paused=True, reset_prefix_cache=True)
    assert (await _call(app, "GET", "/is_sleeping")).json() == {"is_sleeping": False}
    assert (await _call(app, "GET", "/is_paused")).json() == {"is_paused": True}
    assert (await _call(app, "POST", "/reset_prefix_cache")).json() == {"reset": True}


async def test_world_size_is_tp_x_pp_x_dp_and_include_dp_false_drops_dp() -> None:
    app = _app()
    assert (await _call(app, "GET", "/get_world_size")).json() == {"world_size": 24}
    for no in (b"include_dp=false", b"include_dp=False", b"include_dp=0"):
        assert (await _call(app, "GET", "/get_world_size", no)).json() == {"world_size": 6}
    answer = await _call(app, "GET", "/get_world_size", b"include_dp=true")
    assert answer.json() == {"world_size": 24}


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (OperationError("invalid", "level must be one of 0, 1, 2"), 400, "invalid"),
        (OperationError("unsupported", "profiling needs a directory"), 400, "unsupported"),
        (OperationError("conflict", "the engine is already paused"), 409, "conflict"),
    ],
)
async def test_an_engine_refusal_is_a_400_or_a_409_with_its_message(
    error: OperationError, status: int, code: str
) -> None:
    app = _app()
    _recorder(app).raises = error
    answer = await _call(app, "POST", "/pause")
    assert answer.status == status
    assert _error(answer) == {
        "message": error.message,
        "type": "ConflictError" if status == 409 else "BadRequestError",
        "param": None,
        "code": code,
    }


async def test_a_dead_engine_is_a_503_and_a_failure_a_500_that_keeps_its_details() -> None:
    app = _app()
    _recorder(app).raises = EngineDeadError("the engine core died: exit 9")
    answer = await _call(app, "POST", "/resume")
    assert answer.status == 503
    assert "exit 9" not in answer.body.decode()
    _recorder(app).raises = RuntimeError("resume failed: ValueError: /secret/path")
    answer = await _call(app, "POST", "/resume")
    assert answer.status == 500
    assert _error(answer)["message"] == "/resume failed; the server log has the details"


async def test_the_model_cards_weight_version_is_the_engines_or_the_last_one_seen(
    autojump_clock: trio.abc.Clock,
) -> None:
    app = _app()
    recorder = _recorder(app)
    recorder.answers["weight_version"] = 3

    async def version() -> int:
        [card] = (await _call(app, "GET", "/v1/models")).json()["data"]
        return int(card["weight_version"])

    assert await version() == 3
    recorder.raises = RuntimeError("unknown utility method 'weight_version'")
    assert await version() == 3
    recorder.raises = None
    recorder.answers["weight_version"] = 4

    async def never(method: str, *args: Any) -> list[Any]:
        await trio.sleep_forever()
        raise AssertionError

    app.engine.admin = EngineAdmin(never)  # type: ignore[attr-defined]
    started = trio.current_time()
    assert await version() == 3
    assert trio.current_time() - started == pytest.approx(WEIGHT_VERSION_TIMEOUT)


# What the edge refuses before the engine hears of it


@pytest.mark.parametrize(
    ("path", "query", "param"),
    [
        ("/sleep", b"level=7", "level"),
        ("/sleep", b"level=", "level"),
        ("/sleep", b"level=01", "level"),
        ("/sleep", b"level=1&level=2", "level"),
        ("/sleep", b"tags=foo", "tags"),
        ("/sleep", b"tags=weights&tags=", "tags"),
        ("/sleep", b"levle=2", "levle"),
        ("/wake_up", b"tags=weights&tags=everything", "tags"),
        ("/wake_up", b"level=1", "level"),
        ("/pause", b"mode=x", "mode"),
        ("/pause", b"mode=ABORT", "mode"),
        ("/pause", b"mode=abort&mode=wait", "mode"),
        ("/resume", b"mode=abort", "mode"),
        ("/is_sleeping", b"x=1", "x"),
        ("/get_world_size", b"include_dp=maybe", "include_dp"),
        ("/update_weights_from_disk", b"model_path=/m", "model_path"),
    ],
)
async def test_a_bad_query_parameter_is_a_400_naming_it(
    path: str, query: bytes, param: str
) -> None:
    app = _app()
    [method] = ADMIN_ROUTES[path]
    answer = await _call(app, method, path, query, body=BODIES.get(path))
    assert answer.status == 400
    error = _error(answer)
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")
    assert _recorder(app).calls == []


@pytest.mark.parametrize(
    ("query", "why"),
    [
        (b"level", "malformed"),
        (b"level=1&", "malformed"),
        (b"&", "malformed"),
        (b"level=%ff", "percent-encoded UTF-8"),
        (b"level=\xc3\xa9", "percent-encoded UTF-8"),
        (b"tags=weights&" * MAX_QUERY_FIELDS + b"tags=weights", "more than"),
        (b"level=" + b"1" * MAX_QUERY_BYTES, "longer than"),
    ],
)
async def test_a_malformed_query_string_is_a_400(query: bytes, why: str) -> None:
    app = _app()
    answer = await _call(app, "POST", "/sleep", query)
    assert answer.status == 400
    assert why in _error(answer)["message"]
    assert _recorder(app).calls == []


def test_a_query_at_the_bounds_parses_and_one_past_is_refused() -> None:
    fields = b"&".join([b"tags=weights"] * MAX_QUERY_FIELDS)
    assert Query(fields, ("tags",)).many("tags", ("weights",)) == ["weights"]
    with pytest.raises(APIError, match="more than"):
        Query(fields + b"&tags=weights", ("tags",))
    longest = b"tags=" + b"w" * (MAX_QUERY_BYTES - 5)
    assert len(longest) == MAX_QUERY_BYTES
    assert Query(longest, ("tags",)).many("tags", ("w" * (MAX_QUERY_BYTES - 5),)) is not None
    with pytest.raises(APIError, match="longer than"):
        Query(longest + b"w", ("tags",))


async def test_hostile_query_strings_cost_one_length_check() -> None:
    """Who can reach this: a key holder (without one, the answer is a 401 before the query is
    read). The largest input: a query string as long as the server's request line allows;
    past `MAX_QUERY_BYTES` it is refused unsplit, so thousands of parameters or a megabyte of
    one value cost no more than a short one."""
    app = _app()
    hostile = [
        b"tags=weights&" * 5000,
        b"level=" + b"9" * (1 << 20),
        b"&" * 100_000,
        b"%" * 100_000,
    ]
    for query in hostile:
        assert (await _call(app, "POST", "/sleep", query, key=None)).status == 401
        started = time.perf_counter()
        answer = await _call(app, "POST", "/sleep", query)
        assert time.perf_counter() - started < 0.05
        assert answer.status == 400
        assert _error(answer)["message"] == (
            f"the query string is longer than {MAX_QUERY_BYTES} bytes"
        )
    assert _recorder(app).calls == []


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/update_weights_from_disk", {}, "model_path"),
        ("/update_weights_from_disk", {"model_path": 3}, "model_path"),
        ("/update_weights_from_disk", {"model_path": ""}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "a\x00b"}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "m" * 4097}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "m", "load_format": "x"}, "load_format"),
        ("/init_weight_transfer_engine", {"init_info": "shm"}, "init_info"),
        ("/init_weight_transfer_engine", {}, "init_info"),
        ("/update_weights", {"update_info": []}, "update_info"),
        ("/update_weights", {"update_info": {}, "flush": True}, "flush"),
    ],
)
async def test_a_bad_body_is_a_400_naming_its_field(
    path: str, body: dict[str, Any], param: str
) -> None:
    app = _app()
    answer = await _call(app, "POST", path, body=body)
    assert answer.status == 400
    assert _error(answer)["param"] == param
    assert _recorder(app).calls == []


@pytest.mark.parametrize(
    ("body", "status", "why"),
    [
        (b"", 400, "invalid JSON"),
        (b"{", 400, "invalid JSON"),
        (
            b'{"update_info": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
            400,
            "nested too deeply",
        ),
        (b'{"update_info": {"x": "' + b"a" * 2048 + b'"}}', 413, "exceeds the limit"),
    ],
)
async def test_a_body_that_is_not_json_or_is_too_big_is_refused(
    body: bytes, status: int, why: str
) -> None:
    app = _app(max_body_size=1 << 20 if status != 413 else 1024)
    answer = await _call(app, "POST", "/update_weights", body=body)
    assert answer.status == status
    assert why in _error(answer)["message"]
    assert _recorder(app).calls == []


# Real servers: the flag's wiring, and what the engine does with the calls


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """Two `triode serve` of tiny-random in fp32, started together: one plain, one with
    `--enable-admin-api` and an API key. Each is stopped on exit, its engine core with it."""
    logs = tmp_path_factory.mktemp("admin-servers")
    common = ["tiny-random", "--dtype", "float32", "--max-model-len", "256"]
    specs = [
        (common, logs / "plain.log", None),
        ([*common, "--enable-admin-api", "--api-key", KEY], logs / "admin.log", None),
    ]
    with running_servers(*specs) as started:
        pids = [pid for s in started for pid in (s.process.pid, s.engine_pid())]
        plain, admin = started
        yield plain, admin
    assert not any(alive(pid) for pid in pids)


def _auth(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.slow
def test_a_server_without_the_flag_serves_no_admin_route(servers: tuple[Server, Server]) -> None:
    plain, _ = servers
    with httpx.Client(base_url=plain.url, timeout=10) as client:
        for path, method in ADMIN_CALLS:
            answer = client.request(method, path, json=BODIES.get(path))
            assert answer.status_code == 404, (path, answer.text)
            assert answer.json()["error"]["message"] == f"no route for {path}"


@pytest.mark.slow
def test_a_server_with_the_flag_serves_them_behind_the_key(
    servers: tuple[Server, Server],
) -> None:
    _, admin = servers
    with httpx.Client(base_url=admin.url, timeout=30) as client:
        for path, method in ADMIN_CALLS:
            assert client.request(method, path, json=BODIES.get(path)).status_code == 401
        answer = client.get("/is_sleeping", headers=_auth())
        assert answer.status_code == 200 and answer.json() == {"is_sleeping": False}
        answer = client.get("/get_world_size", headers=_auth())
        assert answer.json() == {"world_size": 1}
        answer = client.post("/sleep", params={"level": "7"}, headers=_auth())
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "level"
    assert "without API keys" not in admin.output()


@pytest.mark.slow
def test_pause_resume_and_the_engines_refusals(servers: tuple[Server, Server]) -> None:
    _, admin = servers
    with httpx.Client(base_url=admin.url, headers=_auth(), timeout=30) as client:
        assert client.get("/is_paused").json() == {"is_paused": False}
        paused = client.post("/pause", params={"mode": "keep"})
        assert paused.status_code == 200, paused.text
        assert paused.json()["is_paused"] is True
        assert client.get("/is_paused").json() == {"is_paused": True}
        again = client.post("/pause")
        assert again.status_code == 409
        assert again.json()["error"]["type"] == "ConflictError"
        assert client.post("/resume").status_code == 200
        assert client.get("/is_paused").json() == {"is_paused": False}
        # no --profiler-dir: the engine has nowhere to write a profile
        profile = client.post("/start_profile")
        assert profile.status_code == 400 and "--profiler-dir" in profile.text
        # nothing to update: no transfer was initialised
        assert client.post("/start_weight_update").status_code == 409
        assert client.post("/reset_prefix_cache").json() == {"reset": True}


@pytest.mark.slow
def test_sleep_and_wake_up(servers: tuple[Server, Server]) -> None:
    _, admin = servers
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=admin.url, headers=_auth(), timeout=60) as client:
        before = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        asleep = client.post("/sleep", params={"level": "1"})
        assert asleep.status_code == 200, asleep.text
        assert asleep.json()["is_sleeping"] is True
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        again = client.post("/sleep", params=[("tags", "kv_cache")])
        assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
        assert client.post("/wake_up", params=[("tags", "kv_cache")]).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        after = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert after == before


@pytest.mark.slow
def test_a_pause_whose_client_went_away_still_happens(servers: tuple[Server, Server]) -> None:
    """A wait pause returns once the running requests are done; its client gives up before
    that, and the pause happens all the same."""
    _, admin = servers
    body = {"prompt": "Count:", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=admin.url, headers=_auth(), timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as generation:
            lines = generation.iter_lines()
            next(lines)  # it runs
            with pytest.raises(httpx.ReadTimeout):
                client.post("/pause", params={"mode": "wait"}, timeout=0.2)
            assert client.get("/is_paused").json() == {"is_paused": False}
            events = [line for line in lines if line.startswith("data: {")]
        assert msgspec.json.decode(events[-1][6:])["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 10
        while client.get("/is_paused").json() != {"is_paused": True}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.post("/resume").status_code == 200


@pytest.mark.slow
def test_new_weights_from_disk_raise_the_version_that_answers_report(
    servers: tuple[Server, Server],
) -> None:
    _, admin = servers
    with httpx.Client(base_url=admin.url, headers=_auth(), timeout=60) as client:
        [card] = client.get("/v1/models").json()["data"]
        assert card["weight_version"] == 0
        missing = client.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"})
        assert missing.status_code == 400
        assert missing.json()["error"]["code"] == "invalid"
        updated = client.post("/update_weights_from_disk", json={"model_path": card["root"]})
        assert updated.status_code == 200, updated.text
        assert updated.json()["weight_version"] == 1
        [card] = client.get("/v1/models").json()["data"]
        assert card["weight_version"] == 1
        body = {"prompt": "Hello", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).json()["weight_version"] == 1


@pytest.mark.slow
def test_hostile_queries_over_http_are_answered_at_once(
    servers: tuple[Server, Server], tmp_path: Path
) -> None:
    _, admin = servers
    with httpx.Client(base_url=admin.url, headers=_auth(), timeout=10) as client:
        for query in ("tags=weights&" * 1000, "level=" + "1" * 10_000):
            started = time.perf_counter()
            answer = client.post(f"/sleep?{query}")
            assert answer.status_code == 400
            assert time.perf_counter() - started < 1.0
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
