"""The values the HTTP fuzzer draws from: routes, methods and prompts; values that break any
field's type or range, and the fields themselves; malformed and odd headers; plausible
out-of-range values by field, forged KV-transfer parameters and the edges of the caps on what
one request may cost among them."""

from __future__ import annotations

import base64
from typing import Any

GET_ROUTES = [
    b"/v1/models", b"/health", b"/version", b"/metrics", b"/get_load", b"/get_server_info",
    b"/kv_event_sources", b"/v1/responses/resp_0123456789abcdef", b"/is_sleeping",
    b"/is_paused", b"/get_world_size",
]  # fmt: skip
POST_ROUTES = [
    b"/v1/completions", b"/v1/chat/completions", b"/tokenize", b"/detokenize",
    b"/v1/completions/render", b"/v1/chat/completions/render", b"/v1/embeddings", b"/pooling",
    b"/score", b"/v1/score", b"/rerank", b"/v1/rerank", b"/v2/rerank", b"/v1/responses",
    b"/v1/responses/resp_0123456789abcdef/cancel",
    # the administrative routes: a server without --enable-admin-api has none (404 with the
    # key, 401 without), and one with it takes none without the key
    b"/sleep", b"/wake_up", b"/pause", b"/resume", b"/reset_prefix_cache", b"/start_profile",
    b"/stop_profile", b"/update_weights_from_disk", b"/init_weight_transfer_engine",
    b"/start_weight_update", b"/update_weights", b"/finish_weight_update",
    b"/v1/load_lora_adapter", b"/v1/unload_lora_adapter",
]  # fmt: skip
METHODS = [
    b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"HEAD", b"TRACE", b"CONNECT",
    b"get", b"Post", b"PROPFIND", b"FUZZ", b"G" * 1000, b"G\x00T", b"G\xc3\xa9T", b"", b"GET GET",
    b"\t", b"POST\r\nX-Injected: 1",
]  # fmt: skip
PROMPTS = [
    "Hello", "The capital of France is", "Once upon a time", "1 2 3 4 5", "def f(x):",
    "¿Qué tal?", "\U0001f642\U0001f643", "a " * 300, "<|im_start|>user\nhi<|im_end|>", "\x00\x01",
]  # fmt: skip
# Values that break types and ranges, for any field.
NASTY: list[Any] = [
    -1, 0, 1, -(2**63), 2**63, 2**64 + 1, -(2**70), 10**30, 1e308, -1e308, 1e-320, 0.5, -0.0,
    float("nan"), float("inf"), "NaN", "Infinity", "-inf", "", "x" * 5000, "\ud800", "\x00",
    None, True, False, [], {}, [None], [[]], [[1], "a"], {"": None}, [-5], [2**31], [2**64],
    [49151] * 3, {"1": 1}, {"a": {"b": {"c": []}}},
]  # fmt: skip
FIELDS = [
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "stop",
    "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "min_tokens",
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs",
    "logprobs", "top_logprobs", "echo", "stream", "stream_options", "user", "request_id",
    "priority", "kv_transfer_params", "response_format", "tools", "tool_choice",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "best_of", "suffix", "documents", "unknown_field", "tokens",
    "return_token_strs", "cache_salt", "input", "instructions", "store", "background",
    "previous_response_id", "max_output_tokens", "include", "truncation", "metadata",
]  # fmt: skip
MALFORMED_HEADERS = [
    b"no-colon", b": empty-name", b"bad name: x", b" folded", b"x-nul: a\x00b",
    b"x-high: \xff\xfe", b"x\xff: y",
]  # fmt: skip
ODD_CONTENT_HEADERS = [
    b"content-type: text/plain", b"content-encoding: gzip",
    b"content-type: application/json; charset=utf-16",
]  # fmt: skip
# Out-of-range values that look plausible, by field.
OUT_OF_RANGE: list[tuple[str, Any]] = [
    ("n", 1e9), ("n", 10**9), ("n", 0), ("n", 129), ("max_tokens", -1), ("max_tokens", 0),
    ("max_tokens", 2**31), ("max_tokens", 2**65), ("top_p", 2), ("top_p", 0), ("top_p", -0.5),
    ("logprobs", 1000), ("logprobs", -1), ("logprobs", 21), ("top_logprobs", 1000),
    ("temperature", "NaN"), ("temperature", -1), ("temperature", 1e308), ("top_k", 2**65),
    ("top_k", -2), ("min_p", 1.5), ("seed", 2**64 + 1), ("seed", -(2**63)), ("seed", 2**63),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", 1e308), ("prompt_logprobs", 21), ("prompt_logprobs", 20),
    ("min_tokens", 10**6), ("min_tokens", -1), ("prompt", [2**64]), ("prompt", [-1]),
    ("prompt", [10**9]), ("prompt", [[1, 2], []]), ("prompt", []), ("prompt", ""),
    ("prompt", list(range(5000))), ("logit_bias", {"99999999999999999999": 1}),
    ("logit_bias", {"-1": 5}), ("logit_bias", {"1": 1e308}), ("logit_bias", {"x": 1}),
    ("logit_bias", {"1": float("nan")}), ("logit_bias", {"10000000": 1}), ("stop", [""]),
    ("stop", ["a"] * 1000), ("stop", "x" * 100000), ("stop_token_ids", [-1]),
    ("stop_token_ids", [10**12]), ("allowed_token_ids", []), ("allowed_token_ids", [10**9]),
    ("messages", []), ("messages", [{"role": "robot", "content": "hi"}]),
    ("messages", [{"role": "user"}]), ("messages", [{"role": "user", "content": None}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    ("messages", [{"role": "user", "content": [{"type": "text"}]}]),
    ("messages", [{"role": "assistant", "content": None}]),
    ("messages", [{"role": "user", "content": "hi", "tool_calls": [{"x": 1}]}]),
    ("messages", [{"role": "user", "content": "\ud800\udfff\ud800"}]),
    ("chat_template_kwargs", {"raise_exception": 1}), ("chat_template_kwargs", {"messages": 1}),
    ("chat_template_kwargs", {"bos_token": None}), ("chat_template_kwargs", {"x" * 1000: 1}),
    ("chat_template_kwargs", {"tools": [{"a": 1}]}), ("chat_template_kwargs", {"range": 1}),
    ("chat_template_kwargs", {"add_generation_prompt": "yes"}),
    ("stream_options", {"include_usage": True}), ("best_of", 5), ("echo", True),
    ("tokens", [2**31]), ("tokens", [-1]), ("tokens", list(range(100000))),
    ("cache_salt", ""), ("cache_salt", "x" * 257), ("cache_salt", "x" * 100000),
    ("cache_salt", 7), ("cache_salt", ["a"]), ("cache_salt", {"a": "b"}), ("cache_salt", "\ud800"),
    # kv_transfer_params a client forges: unsealed, with a made-up seal, odd JSON in them
    ("kv_transfer_params", {"do_remote_decode": True}),
    ("kv_transfer_params", {"do_remote_decode": True, "seal": "0" * 64, "nonce": "n",
                            "issued_at": 0, "expires_at": 2**62}),
    ("kv_transfer_params", lambda: _remote_prefill(seal="f" * 64)),
    ("kv_transfer_params", lambda: _remote_prefill()),
    ("kv_transfer_params", lambda: _remote_prefill(remote_num_tokens=2**64)),
    ("kv_transfer_params", lambda: _remote_prefill(remote_block_ids=list(range(200_000)))),
    ("kv_transfer_params", lambda: _remote_prefill(remote_block_ids=[{"a": [1]}])),
    ("kv_transfer_params", lambda: _remote_prefill(remote_endpoints=["tcp://169.254.169.254:1"])),
    ("kv_transfer_params", lambda: _remote_prefill(transport="shm", extra=_nested(200))),
    ("kv_transfer_params", {"do_remote_decode": True, "do_remote_prefill": True}),
    ("kv_transfer_params", {"do_remote_prefill": "yes"}), ("kv_transfer_params", [1]),
    ("kv_transfer_params", {str(i): i for i in range(100)}),
    # the edges of the caps on what one request may cost: just past them, and at them
    ("stop", [f"s{i}" for i in range(65)]), ("stop", ["y" * 256] * 64), ("stop", "z" * 257),
    ("logit_bias", {str(i): 1 for i in range(301)}),
    ("logit_bias", {str(i): -1 for i in range(300)}),
    ("stop_token_ids", [7] * 100_000), ("allowed_token_ids", [1, 2] * 50_000),
    ("allowed_token_ids", [1] * ((1 << 18) + 1)), ("prompt", ["a"] * 2049), ("n", 128),
    ("top_logprobs", 20), ("logprobs", 20),
    ("guided_json", "[" * 100_000), ("guided_json", '{"a": ' * 5000 + "1" + "}" * 5000),
    ("guided_json", lambda: {"type": "object", "x": _nested(130)}),
    ("structured_outputs", {"json": "{" * 50_000}),
    ("response_format", lambda: {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": _nested(130)}}),
    ("messages", [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "[" * 100_000}}]}]),
    ("prompt_embeds", lambda: _saved_tensor(expanded=True)),
    ("prompt_embeds", lambda: [_saved_tensor(expanded=False)] * 40),  # 12 MB, 9 MB decoded
]  # fmt: skip


def _remote_prefill(**fields: Any) -> dict[str, Any]:
    """A decode request's params as a prefill would make them, but not sealed by one."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
        "remote_request_id": "r", "remote_block_ids": [0, 1], "remote_host": "127.0.0.1",
        "remote_port": 1, "remote_endpoints": ["tcp://127.0.0.1:1"], "remote_num_tokens": 20,
        "remote_secret": "s", "tp_size": 1, "pp_size": 1, "block_size": 16, "transport": "tcp",
        "prompt_digest": "0" * 64, "issued_at": 0, "expires_at": 2**62, **fields,
    }  # fmt: skip


def _nested(depth: int) -> dict[str, Any]:
    """An object `depth` deep: within the body decoder's limit, past the one on schemas."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def _saved_tensor(*, expanded: bool) -> str:
    """A `torch.save`d prompt of 2000 positions of SmolLM2's width, base64: an expanded view of
    one row (3.9 KB that would be 4.6 MB), or 100 real rows (230 KB). torch is imported here,
    on the first such plan only."""
    import io

    import torch

    row = torch.zeros(1, 576)
    tensor = row.expand(2000, 576) if expanded else torch.randn(100, 576)
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()
