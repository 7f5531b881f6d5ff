"""What the HTTP fuzzer sends: `HttpMutator` draws one `Plan` (raw bytes plus how to send them)
at a time from a seeded `random.Random`.

Kinds, by weight: valid requests with random sampling parameters, bodies with bad JSON, wrong
types and out-of-range values, mutated paths (`//v1`, `/v1/../`, percent-escapes, case, NUL and
non-ASCII bytes, very long), junk methods, missing or wrong keys, header floods and broken
framing, bodies trickled slowly, bodies cut short, bodies over the size cap, streams dropped
part-way, and pipelined requests on one connection with different keys.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable
from typing import Any

from .http_plan import INVALID, UNSURE, VALID, Plan, Req
from .http_values import (
    FIELDS,
    GET_ROUTES,
    MALFORMED_HEADERS,
    METHODS,
    NASTY,
    ODD_CONTENT_HEADERS,
    OUT_OF_RANGE,
    POST_ROUTES,
    PROMPTS,
)

BODY_CAP = 16 << 20  # the server's default --max-body-size
UNREAD_LIMIT = 64 << 10  # what a server takes in with one read


class HttpMutator:
    """Draws plans for a server at `host` with API key `key` (None: open) serving `model`."""

    KINDS: dict[str, int] = {
        "valid": 18, "json": 22, "path": 12, "method": 7, "auth": 10, "headers": 7,
        "slow": 3, "truncated": 4, "huge": 1, "disconnect": 10, "keepalive": 6,
    }  # fmt: skip

    def __init__(self, rng: random.Random, host: bytes, key: str | None, model: str) -> None:
        self.rng = rng
        self.host = host
        self.key = key.encode() if key else None
        self.model = model
        self._kinds = list(self.KINDS)
        self._weights = list(self.KINDS.values())
        self._makers: dict[str, Callable[[], Plan]] = {
            "valid": self._valid, "json": self._bad_json, "path": self._odd_path,
            "method": self._odd_method, "auth": self._keys, "headers": self._odd_headers,
            "slow": self._slow, "truncated": self._truncated, "huge": self._huge,
            "disconnect": self._disconnect, "keepalive": self._keepalive,
        }  # fmt: skip

    def plan(self) -> Plan:
        kind = self.rng.choices(self._kinds, self._weights)[0]
        plan = self._makers[kind]()
        plan.kind = kind
        if len(plan.data) > UNREAD_LIMIT or plan.filler:
            # A server may answer before it has read everything, then close; the rest of the
            # bytes make the close a reset, which can overtake the answer.
            plan.expect_answer = False
        return plan

    # Building blocks

    def _head(self, method: bytes, target: bytes, lines: list[bytes]) -> bytes:
        return b"\r\n".join([method + b" " + target + b" HTTP/1.1", *lines]) + b"\r\n\r\n"

    def _request(
        self,
        method: bytes,
        target: bytes,
        body: bytes | None = None,
        *,
        auth: tuple[list[bytes], str] | None = None,
        extra: list[bytes] | None = None,
        close: bool = True,
        length: int | None = None,
    ) -> tuple[bytes, Req]:
        auth_lines, state = auth if auth is not None else self._auth()
        lines = [b"host: " + self.host, *auth_lines, *(extra or [])]
        if body is not None:
            size = len(body) if length is None else length
            lines += [b"content-type: application/json", b"content-length: %d" % size]
        if close:
            lines.append(b"connection: close")
        return self._head(method, target, lines) + (body or b""), Req(method, target, state)

    def _single(self, method: bytes, target: bytes, body: bytes | None = None, **kw: Any) -> Plan:
        data, req = self._request(method, target, body, **kw)
        return Plan("", [req], data)

    def _auth(self, p_valid: float = 0.85) -> tuple[list[bytes], str]:
        if self.key is None:
            return [], VALID
        if self.rng.random() < p_valid:
            return [b"authorization: Bearer " + self.key], VALID
        return self._auth_variant()

    def _auth_variant(self) -> tuple[list[bytes], str]:
        if self.key is None:
            return [], VALID
        key, rng = self.key, self.rng
        bearer = b"authorization: Bearer "
        variants: list[tuple[list[bytes], str]] = [
            ([], INVALID),
            ([bearer + key], VALID),
            ([b"Authorization: Bearer " + key], VALID),
            ([b"authorization: bearer " + key], UNSURE),
            ([b"authorization: BEARER " + key], UNSURE),
            ([b"authorization: Bearer  " + key], UNSURE),
            ([bearer + key + b" \t"], UNSURE),
            ([bearer + b"wrong-key"], INVALID),
            ([bearer + key[:-1]], INVALID),
            ([bearer + key + b"x"], INVALID),
            ([bearer + key + b"," + key], INVALID),
            ([bearer + key.swapcase()], INVALID),
            ([b"authorization: " + key], INVALID),
            ([b"authorization: Basic " + base64.b64encode(b"user:" + key)], INVALID),
            ([b"authorization: Bearer"], INVALID),
            ([b"authorization:"], INVALID),
            ([bearer + key + b"\x00"], INVALID),
            ([bearer + b"\xff\xfe" + key], INVALID),
            ([bearer + b"k" * rng.choice([100, 10_000, 100_000])], INVALID),
            ([b"x-api-key: " + key], INVALID),
            ([b"proxy-authorization: Bearer " + key], INVALID),
            ([b"authorization : Bearer " + key], INVALID),
            ([bearer + b"wrong", bearer + key], UNSURE),
            ([bearer + key, bearer + b"wrong"], UNSURE),
        ]
        return rng.choice(variants)

    def _encode(self, value: Any) -> bytes:
        ascii_only = self.rng.random() < 0.5
        return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")

    def _prompt(self) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            return rng.choice(PROMPTS)
        if roll < 0.8:
            return [rng.randrange(1, 1000) for _ in range(rng.randint(1, 40))]
        if roll < 0.9:
            return [rng.choice(PROMPTS) for _ in range(rng.randint(1, 3))]
        return [[rng.randrange(1, 1000) for _ in range(rng.randint(1, 10))] for _ in range(2)]

    def _sampling(self, body: dict[str, Any], *, chat: bool, stream: bool) -> dict[str, Any]:
        rng = self.rng
        options: list[tuple[str, Callable[[], Any]]] = [
            ("temperature", lambda: rng.choice([0, 0.3, 1.0, 1.8])),
            ("top_p", lambda: rng.uniform(0.05, 1.0)),
            ("top_k", lambda: rng.choice([-1, 0, 1, 5, 50])),
            ("min_p", lambda: rng.uniform(0, 0.5)),
            ("seed", lambda: rng.randrange(-(2**40), 2**40)),
            ("presence_penalty", lambda: rng.uniform(-2, 2)),
            ("frequency_penalty", lambda: rng.uniform(-2, 2)),
            ("repetition_penalty", lambda: rng.uniform(0.5, 2)),
            ("n", lambda: rng.randint(1, 3)),
            ("stop", lambda: rng.choice(["the", "\n", ["a", "e"], "ab" * 5])),
            ("stop_token_ids", lambda: [rng.randrange(1000) for _ in range(3)]),
            ("ignore_eos", lambda: rng.random() < 0.5),
            ("min_tokens", lambda: rng.randint(0, body.get("max_tokens", 1))),
            ("logit_bias", lambda: {str(rng.randrange(1000)): rng.uniform(-100, 100)}),
            ("allowed_token_ids", lambda: [rng.randrange(1000) for _ in range(5)]),
            ("include_stop_str_in_output", lambda: rng.random() < 0.5),
            ("skip_special_tokens", lambda: rng.random() < 0.5),
            ("prompt_logprobs", lambda: rng.randint(0, 3)),
            ("user", lambda: "fuzz"),
            ("cache_salt", lambda: rng.choice(["a", "tenant-2", "\u00e9\U0001f642", "x" * 256])),
        ]
        if chat:
            options.append(("logprobs", lambda: True))
            if body.get("logprobs"):
                options.append(("top_logprobs", lambda: rng.randint(0, 5)))
        else:
            options += [("logprobs", lambda: rng.randint(0, 5)), ("echo", lambda: True)]
        if stream:
            usage = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5}
            options.append(("stream_options", lambda: usage))
        for name, value in rng.sample(options, rng.randint(0, 6)):
            body[name] = value()
        if chat and body.get("top_logprobs") and not body.get("logprobs"):
            body["logprobs"] = True
        return body

    def _generation(self, *, chat: bool | None = None, stream: bool | None = None) -> dict:
        rng = self.rng
        chat = rng.random() < 0.5 if chat is None else chat
        stream = rng.random() < 0.4 if stream is None else stream
        body: dict[str, Any] = {"max_tokens": rng.randint(1, 24)}
        if rng.random() < 0.7:
            body["model"] = self.model
        if chat:
            messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
            if rng.random() < 0.3:
                messages.insert(0, {"role": "system", "content": "Be brief."})
            body["messages"] = messages
        else:
            body["prompt"] = self._prompt()
        if stream:
            body["stream"] = True
        return self._sampling(body, chat=chat, stream=stream)

    def _response(self) -> dict[str, Any]:
        """A `/v1/responses` body: a string or message input, stored or not, streamed or not,
        with a `user` near its 256-character cap now and then."""
        rng = self.rng
        body: dict[str, Any] = {"max_output_tokens": rng.randint(1, 24)}
        if rng.random() < 0.5:
            body["input"] = rng.choice(PROMPTS)
        else:
            body["input"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        if rng.random() < 0.7:
            body["model"] = self.model
        if rng.random() < 0.5:
            body["store"] = rng.random() < 0.5
        if rng.random() < 0.3:
            body["stream"] = True
        if rng.random() < 0.2:
            body["user"] = "u" * rng.choice([1, 255, 256, 257, 5000])
        if rng.random() < 0.2:
            body["instructions"] = "Be brief."
        return body

    def _endpoint_body(self) -> tuple[bytes, dict[str, Any]]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.45:
            return b"/v1/completions", self._generation(chat=False)
        if roll < 0.8:
            return b"/v1/chat/completions", self._generation(chat=True)
        if roll < 0.9:
            return b"/v1/responses", self._response()
        if roll < 0.95:
            if rng.random() < 0.5:
                return b"/tokenize", {"prompt": rng.choice(PROMPTS), "return_token_strs": True}
            return b"/tokenize", {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
        return b"/detokenize", {"tokens": [rng.randrange(1000) for _ in range(rng.randint(0, 20))]}

    # Kinds

    def _valid(self) -> Plan:
        if self.rng.random() < 0.12:
            return self._single(b"GET", self.rng.choice(GET_ROUTES))
        route, body = self._endpoint_body()
        return self._single(b"POST", route, self._encode(body))

    def _bad_json(self) -> Plan:
        rng = self.rng
        route, body = self._endpoint_body()
        roll = rng.random()
        if roll < 0.35:
            name = rng.choice(FIELDS)
            value = rng.choice(NASTY)
            if not (name in ("max_tokens", "max_completion_tokens") and value is None):
                body[name] = value  # a null max_tokens asks for the whole context: too slow
            data = self._encode(body)
        elif roll < 0.6:
            name, value = rng.choice(OUT_OF_RANGE)
            body[name] = value() if callable(value) else value
            data = self._encode(body)
        else:
            data = self._garble(self._encode(body))
        return self._single(b"POST", route, data)

    def _garble(self, data: bytes) -> bytes:
        rng = self.rng
        at = rng.randrange(len(data) + 1)
        edits: list[Callable[[], bytes]] = [
            lambda: data[:at],
            lambda: data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :],
            lambda: data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at:],
            lambda: data[:at] + data[at + rng.randint(1, 20) :],
            lambda: rng.choice([b"", b"null", b"[]", b'"s"', b"123", b"{}", b"\xef\xbb\xbf{}"]),
            lambda: b"[" * rng.choice([100, 10_000, 200_000]),
            lambda: b'{"prompt": ' + b"[" * rng.choice([100, 10_000, 200_000]),
            lambda: b"\xef\xbb\xbf" + data,
            lambda: data.decode("utf-8", "replace").encode("utf-16"),
            lambda: data + b" garbage",
            lambda: data + data,
            lambda: b'{"prompt": 1, ' + data[1:],
            lambda: data.replace(b"1", rng.choice([b"1e999999", b"-0", b"9" * 400, b"NaN"]), 1),
            lambda: data.replace(b'"', b'"\xff', 1),
            lambda: data.replace(b'":', b'\xed\xa0\x80":', 1),
            lambda: data.replace(b'"max_tokens"', b'"max_tokens\\u0000"', 1),
        ]
        return rng.choice(edits)()

    def _odd_path(self) -> Plan:
        rng = self.rng
        post = rng.random() < 0.5
        route = rng.choice(POST_ROUTES if post else GET_ROUTES)
        n = rng.choice([1_000, 10_000, 100_000, 1_000_000])
        variants: list[Callable[[bytes], bytes]] = [
            lambda r: b"/" + r,
            lambda r: r.replace(b"/v1/", b"/v1//"),
            lambda r: b"/v1/.." + r,
            lambda r: b"/x/.." + r,
            lambda r: b"/health/.." + r,
            lambda r: r.replace(b"/v1/", b"/v1/./"),
            lambda r: b"/%2e%2e" + r,
            lambda r: b"/v1/%2e%2e" + r,
            lambda r: r[:3] + r[3:].replace(b"/", b"%2F"),
            lambda r: r.replace(b"/", b"%2F"),
            lambda r: r.replace(b"v1", b"%76%31"),
            lambda r: r.replace(b"v1", b"%2576%2531"),
            lambda r: r.replace(b"v1", b"V1"),
            lambda r: r.upper(),
            lambda r: r + b"/",
            lambda r: r + b"?" + rng.choice([b"x=1", b"a=%00", b"", b"?" * 100, b"\xff"]),
            lambda r: r + b"#frag",
            lambda r: r + rng.choice([b"%00", b"\x00", b"\xff\xfe", "é".encode(), b"%", b"%zz"]),
            lambda r: r + b";x=1",
            lambda r: r.replace(b"/v1", b"/v1;"),
            lambda r: r.replace(b"/", b"\\"),
            lambda r: b"http://" + self.host + r,
            lambda r: b"HTTP://evil.example" + r,
            lambda r: r[1:],
            lambda r: b"*",
            lambda r: b"",
            lambda r: r + b"/" + b"a" * n,
            lambda r: b"/" + b"a" * n,
            lambda r: r + b"%2F..%2F..%2Fhealth",
            lambda r: r + b"/..",
            lambda r: r.replace(b"/", b"/%2e/"),
            lambda r: r.replace(b"/v1", b"/api/v1"),
            lambda r: r + b" HTTP/1.1\r\nX-Smuggled: 1",
        ]
        target = rng.choice(variants)(route)
        body = self._encode(self._generation(stream=False)) if post else None
        return self._single(b"POST" if post else b"GET", target, body, auth=self._auth(0.5))

    def _odd_method(self) -> Plan:
        rng = self.rng
        method = rng.choice(METHODS)
        route = rng.choice(GET_ROUTES + POST_ROUTES)
        body = None
        if method not in (b"GET", b"HEAD") or rng.random() < 0.2:
            body = self._encode(self._generation(stream=False))
        extra = []
        if method == b"OPTIONS" and rng.random() < 0.5:
            extra = [b"origin: http://evil.example", b"access-control-request-method: POST"]
        return self._single(method, route, body, auth=self._auth(0.6), extra=extra)

    def _keys(self) -> Plan:
        route, body = self._endpoint_body()
        if self.rng.random() < 0.3:
            return self._single(b"GET", b"/v1/models", auth=self._auth_variant())
        return self._single(b"POST", route, self._encode(body), auth=self._auth_variant())

    def _odd_headers(self) -> Plan:
        rng = self.rng
        body = self._encode({"prompt": "Hello", "max_tokens": 1})
        auth, state = self._auth()
        lines = [b"host: " + self.host, *auth, b"content-type: application/json"]
        length = b"content-length: %d" % len(body)
        framing = unknown_coding = False
        roll = rng.randrange(14)
        if roll == 0:
            count = rng.choice([100, 500, 3000])
            lines += [b"x-fuzz-%d: %s" % (i, rng.randbytes(8).hex().encode()) for i in range(count)]
        elif roll == 1:
            lines.append(b"x-big: " + b"v" * rng.choice([10_000, 100_000, 1_000_000]))
        elif roll == 2:
            lines += [b"authorization: Bearer wrong"] * rng.choice([10, 1000])
        elif roll == 3:
            lines.append(b"content-length: %d" % (len(body) + rng.randint(1, 9)))
            framing = True
        elif roll == 4:
            lines.append(b"transfer-encoding: chunked")
            framing = True
        elif roll == 5:
            length = b"content-length: " + rng.choice(
                [b"-1", b"abc", b"1e3", b"9" * 30, b"9" * 5000, b" 5", b"0x10", b"+5", b""]
            )
            framing = True
        elif roll == 6:
            lines = [line for line in lines if not line.startswith(b"host")]
            lines.append(rng.choice([b"", b"host: a", b"host: \xff", b"host: a b"]))
        elif roll == 7:
            lines.append(rng.choice(MALFORMED_HEADERS))
        elif roll == 8:
            lines.append(b"expect: 100-continue")
        elif roll == 9:
            lines.append(rng.choice(ODD_CONTENT_HEADERS))
        elif roll == 10:
            lines.append(b"transfer-encoding: " + rng.choice([b"gzip", b"chunked, identity", b"x"]))
            framing = unknown_coding = True
        elif roll == 11:
            head = b"\n".join([b"POST /v1/completions HTTP/1.1", *lines, length]) + b"\n\n"
            return Plan("", [Req(b"POST", b"/v1/completions", state)], head + body)
        elif roll == 12:
            version = rng.choice([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9.9", b"http/1.1", b"HTTP/1"])
            head = b"\r\n".join([b"POST /v1/completions " + version, *lines, length])
            data = head + b"\r\n\r\n" + body
            req = Req(b"POST", b"/v1/completions", state)
            return Plan("", [req], data, truncate=len(data), expect_answer=False)
        else:
            lines.append(b"x-many: " + b",".join([b"a"] * 5000))
        data = self._head(b"POST", b"/v1/completions", [*lines, length, b"connection: close"])
        data += body
        req = Req(b"POST", b"/v1/completions", state, unknown_coding)
        if framing:  # the server may wait for bytes that never come: end the stream
            return Plan("", [req], data, truncate=len(data), expect_answer=False)
        return Plan("", [req], data)

    def _slow(self) -> Plan:
        rng = self.rng
        route, body = self._endpoint_body()
        plan = self._single(b"POST", route, self._encode(body))
        plan.pieces = rng.randint(2, 12)
        plan.delay = rng.uniform(0.02, 0.3)
        return plan

    def _truncated(self) -> Plan:
        rng = self.rng
        route, body = self._endpoint_body()
        data = self._encode(body)
        plan = self._single(b"POST", route, data, length=len(data) + rng.randint(1, 1000))
        plan.truncate = len(plan.data) - len(data) + rng.randrange(len(data) + 1)
        plan.expect_answer = False
        if rng.random() < 0.5:
            plan.linger = rng.uniform(0, 0.5)
        return plan

    def _huge(self) -> Plan:
        rng = self.rng
        roll = rng.random()
        if roll < 0.5:  # declared too large: refused before it is read
            size = rng.choice([BODY_CAP + 1, 2**31, 2**40, 10**20])
            return self._single(b"POST", rng.choice(POST_ROUTES), b'{"prompt": "', length=size)
        extra = BODY_CAP + rng.randint(1, 1 << 16)
        if roll < 0.75:  # really sent, chunked: refused once the count passes the cap
            chunked = [b"transfer-encoding: chunked"]
            data, req = self._request(b"POST", b"/v1/completions", extra=chunked)
            return Plan("", [req], data, filler=extra, chunked=True, expect_answer=False)
        data, req = self._request(b"POST", b"/tokenize", b"", length=extra)
        return Plan("", [req], data, filler=extra, expect_answer=False)

    def _disconnect(self) -> Plan:
        rng = self.rng
        stream = rng.random() < 0.75
        body = self._generation(stream=stream)
        body["max_tokens"] = rng.randint(16, 256)
        body["ignore_eos"] = rng.random() < 0.5
        stall = stream and rng.random() < 0.15
        if stall:  # a reader that stops reading: answers back up until the server's sends block
            body.update(max_tokens=1500, ignore_eos=True, n=8, stop=None, min_tokens=0)
            body.pop("stop_token_ids", None)
            body.update(
                {"logprobs": True, "top_logprobs": 5} if "messages" in body else {"logprobs": 5}
            )
        route = b"/v1/chat/completions" if "messages" in body else b"/v1/completions"
        plan = self._single(b"POST", route, self._encode(body), auth=self._auth(1.0))
        if stall:
            plan.linger = rng.uniform(1, 3)
        elif stream and rng.random() < 0.8:
            plan.read_limit = rng.randint(1, 6000)
        else:
            plan.linger = rng.uniform(0, 0.8)
        plan.expect_answer = False
        return plan

    def _keepalive(self) -> Plan:
        rng = self.rng
        data, reqs = b"", []
        count = rng.randint(2, 4)
        for i in range(count):
            auth = self._auth(1.0) if i == 0 else self._auth_variant()
            if rng.random() < 0.5:
                part, req = self._request(b"GET", b"/v1/models", auth=auth, close=i == count - 1)
            else:
                body = self._encode({"prompt": rng.choice(PROMPTS), "max_tokens": 2})
                part, req = self._request(
                    b"POST", b"/v1/completions", body, auth=auth, close=i == count - 1
                )
            data += part
            reqs.append(req)
        return Plan("", reqs, data)
