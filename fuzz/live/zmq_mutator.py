"""What the ZMQ fuzzer sends: `ZmqMutator` draws one input message (a list of frames) at a
time from a seeded `random.Random`.

Kinds, by weight: byte-level mutations of valid messages (bits flipped, bytes cut, spliced or set
to msgpack markers, aux frames added or dropped), valid messages with one field set to anything
at all (past the schema's checks), valid ADD requests (huge prompts, out-of-vocabulary token ids,
extreme sampling parameters, reused request ids, shared prefixes), aborts (of unknown, live and
finished ids, and of ten thousand at once), utility calls (unknown methods, wrong arguments),
random bytes, and valid payloads under the wrong type byte.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import msgspec

from triode.wire import (
    Encoder,
    EngineCoreRequest,
    EngineCoreRequestType,
    SamplingParams,
    UtilityCall,
    encode_input,
)
from triode.wire.messages import MAX_STOP_STRING_LENGTH, MAX_WIRE_CACHE_SALT

FUZZ_CLIENT = 1  # the output topic the fuzzer's own requests and calls answer on
ADD, ABORT, UTILITY = (
    EngineCoreRequestType.ADD_REQUEST,
    EngineCoreRequestType.ABORT_REQUEST,
    EngineCoreRequestType.UTILITY,
)

# Values for a field of a message, encoded past the schema's checks.
NASTY: list[Any] = [
    -1, 0, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1e308, -1e308, math.nan, math.inf, -math.inf,
    "", "x" * 10_000, "\x00", None, True, [], {}, [None], {"a": 1}, {1: 2}, b"bytes",
    msgspec.msgpack.Ext(1, b"\x00\x01"), [2**31] * 3, [-1], list(range(50_000)), [[1]], [""],
]  # fmt: skip
MARKERS = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0xC0, 0xC1, 0xC4, 0xC7, 0xCF, 0xD3, 0xD4, 0xD8, 0xDB,
           0xDC, 0xDD, 0xDE, 0xDF, 0xFF]  # fmt: skip
SAFE_UTILITIES = ["get_stats", "reset_prefix_cache", "is_sleeping", "wake_up"]
ODD_UTILITIES = ["nope", "", "__init__", "_call_utility", "run", "get_stats ", "GET_STATS",
                 "x" * 5000, "sleep\x00", "__class__"]  # fmt: skip


class ZmqMutator:
    """Draws input messages (lists of frames) for an engine with `vocab_size` tokens."""

    KINDS: dict[str, int] = {
        "random": 8, "add": 20, "abort": 8, "utility": 8, "schema": 20, "mutate": 30, "type": 6,
    }  # fmt: skip

    def __init__(self, rng: random.Random, vocab_size: int, max_model_len: int) -> None:
        self.rng = rng
        self.vocab = vocab_size
        self.max_len = max_model_len
        self.encoder = Encoder()
        self.ids: list[str] = []  # request ids drawn so far, to reuse and abort
        self.prompts: list[list[int]] = []  # recent prompts, to share prefixes with
        self._count = 0
        self._makers: dict[str, Callable[[], list[bytes]]] = {
            "random": self._random, "add": self._add, "abort": self._abort,
            "utility": self._utility, "schema": self._schema, "mutate": self._mutate,
            "type": self._retype,
        }  # fmt: skip

    def message(self) -> tuple[str, list[bytes]]:
        kind = self.rng.choices(list(self.KINDS), list(self.KINDS.values()))[0]
        return kind, self._makers[kind]()

    def encode(self, kind: EngineCoreRequestType, payload: Any) -> list[bytes]:
        return [bytes(f) for f in encode_input(self.encoder, kind, payload)]

    # Valid messages

    def _request_id(self) -> str:
        rng = self.rng
        if self.ids and rng.random() < 0.15:
            return rng.choice(self.ids)  # a reused id: live or finished
        self._count += 1
        rid = rng.choice([f"fuzz-{self._count}", f"fuzz-{self._count}/0", "x" * 2000, "\x00"])
        if rid in self.ids:
            rid = f"fuzz-{self._count}-{rid[:8]}"
        self.ids.append(rid)
        return rid

    def _prompt(self) -> list[int]:
        rng = self.rng
        if self.prompts and rng.random() < 0.3:  # shared prefixes, for the prefix cache
            prompt = rng.choice(self.prompts)
            return prompt + [rng.randrange(self.vocab) for _ in range(rng.randint(0, 20))]
        sizes = [1, 2, 7, 16, 17, 33, 100, 300, 1000, self.max_len - 1, self.max_len, 100_000]
        size = rng.choices(sizes, [10, 10, 10, 10, 10, 10, 5, 4, 2, 1, 1, 1])[0]
        if size > 100:
            start = rng.randrange(self.vocab)
            prompt = [(start + 7 * i) % self.vocab for i in range(size)]
        else:
            prompt = [rng.randrange(self.vocab) for _ in range(size)]
        if rng.random() < 0.1:
            prompt[rng.randrange(size)] = rng.choice([self.vocab, self.vocab + 1, 2**31 - 1])
        elif size <= self.max_len:
            self.prompts = [*self.prompts[-19:], prompt]
        return prompt

    def _params(self) -> SamplingParams:
        rng = self.rng
        max_tokens = rng.choice([1, 2, 8, 32, None])

        def token() -> int:
            if rng.random() < 0.9:
                return rng.choice([0, 1, rng.randrange(self.vocab)])
            return rng.choice([self.vocab, 2**31 - 1])  # out of the vocabulary

        return SamplingParams(
            n=rng.choice([1, 1, 1, 2, 128]),
            temperature=rng.choice([0.0, 0.7, 1.0, 1e-6, 100.0, 1e30]),
            top_p=rng.choice([1.0, 0.5, 1e-9]),
            top_k=rng.choice([0, 1, 50, 10**9, 2**62]),
            min_p=rng.choice([0.0, 0.5, 1.0]),
            seed=rng.choice([None, 0, 2**63 - 1, -(2**63 - 1), rng.randrange(2**32)]),
            presence_penalty=rng.uniform(-2, 2),
            frequency_penalty=rng.uniform(-2, 2),
            repetition_penalty=rng.choice([1.0, 1e-9, 1e9, 2.0]),
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, max_tokens or 64),
            stop=rng.choice([[], ["a"], ["\x00"], ["<|im_end|>", "x" * MAX_STOP_STRING_LENGTH]]),
            stop_token_ids=[token() for _ in range(rng.randint(0, 3))],
            include_stop_str_in_output=rng.random() < 0.5,
            ignore_eos=rng.random() < 0.5,
            logprobs=rng.choice([None, 0, 1, 20]),
            prompt_logprobs=rng.choice([None] * 8 + [0, 20]),
            logit_bias=rng.choice([None, {token(): rng.uniform(-100, 100)}]),
            allowed_token_ids=rng.choice([None, [token()], [token() for _ in range(5)]]),
            skip_special_tokens=rng.random() < 0.5,
        )

    def _request(self) -> EngineCoreRequest:
        rng = self.rng
        return EngineCoreRequest(
            self._request_id(),
            self._prompt(),
            self._params(),
            eos_token_id=rng.choice([None, 0, 2, -1, self.vocab, 2**62]),
            arrival_time=rng.choice([0.0, 1.7e9, -1.0, math.nan, math.inf]),
            client_index=FUZZ_CLIENT if rng.random() < 0.8 else rng.randrange(2**16),
            priority=rng.choice([0, 0, 0, -5, 7, -(2**63), 2**63 - 1]),
            kv_transfer_params=rng.choice([None, {}, {"do_remote_prefill": True, "x": [1]}]),
            cache_salt=rng.choice([None, None, "a", "\U0001f642", "x" * MAX_WIRE_CACHE_SALT]),
        )

    def _valid(self) -> list[bytes]:
        roll = self.rng.random()
        if roll < 0.5:
            return self.encode(ADD, self._request())
        if roll < 0.75:
            return self._abort()
        return self._utility()

    def _add(self) -> list[bytes]:
        return self.encode(ADD, self._request())

    def _abort(self) -> list[bytes]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.4 and self.ids:
            ids = rng.sample(self.ids, min(len(self.ids), rng.randint(1, 5)))
        elif roll < 0.7:
            ids = [f"unknown-{rng.randrange(10**9)}" for _ in range(rng.randint(1, 5))]
        elif roll < 0.8:
            ids = []
        elif roll < 0.9:
            ids = [f"bulk-{i}" for i in range(10_000)]
        else:
            ids = ["", "\x00", "x" * 100_000]
        return self.encode(ABORT, ids)

    def _utility(self) -> list[bytes]:
        rng = self.rng
        method = rng.choice(SAFE_UTILITIES if rng.random() < 0.5 else ODD_UTILITIES)
        args = rng.choice([[], [], [1], ["x"], [None, None, None], [list(range(1000))]])
        call_id = rng.choice([rng.randrange(2**31), 0, 2**63 - 1, -(2**63)])
        return self.encode(UTILITY, UtilityCall(call_id, method, args, FUZZ_CLIENT))

    # Invalid ones

    def _random(self) -> list[bytes]:
        rng = self.rng
        sizes = [0, 1, 2, 8, 64, 1 << 20]
        return [rng.randbytes(rng.choice(sizes)) for _ in range(rng.randint(0, 4))]

    def _schema(self) -> list[bytes]:
        """A valid message with one field (or sampling parameter) set to anything at all."""
        rng = self.rng
        kind = rng.choice([ADD, ADD, ADD, ABORT, UTILITY])
        if kind is ADD:
            body: Any = msgspec.to_builtins(self._request())
        elif kind is ABORT:
            body = [f"fuzz-{rng.randrange(100)}"]
        else:
            body = msgspec.to_builtins(UtilityCall(rng.randrange(2**31), "get_stats", [], 1))
        target = body
        if kind is ADD and rng.random() < 0.5:
            target = body[2]  # the sampling parameters
        roll = rng.random()
        if roll < 0.8 and target:
            target[rng.randrange(len(target))] = rng.choice(NASTY)
        elif roll < 0.9:
            target.append(rng.choice(NASTY))  # a field from the future
        elif target:
            del target[rng.randrange(len(target)) :]
        return [kind.value, msgspec.msgpack.encode(body)]

    def _mutate(self) -> list[bytes]:
        rng = self.rng
        frames = self._valid()
        i = rng.randrange(len(frames))
        data = bytearray(frames[i])
        op = rng.randrange(8)
        if op == 0 and data:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == 1:
            del data[rng.randrange(len(data) + 1) :]
        elif op == 2:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == 3:
            other = self._valid()[-1]
            start = rng.randrange(len(other) + 1)
            at = rng.randrange(len(data) + 1)
            data[at:at] = other[start : start + rng.randint(1, 64)]
        elif op == 4 and data:
            data[rng.randrange(len(data))] = rng.choice(MARKERS)
        elif op == 5:
            frames.append(rng.randbytes(rng.choice([0, 4, 300])))
        elif op == 6:
            del frames[i]
            return frames
        else:
            frames.insert(i, frames[i])
        frames[i] = bytes(data)
        return frames

    def _retype(self) -> list[bytes]:
        rng = self.rng
        frames = self._valid()
        frames[0] = rng.choice([b"", b"\x03", b"\xff", b"\x00\x00", ADD.value, ABORT.value])
        return frames
