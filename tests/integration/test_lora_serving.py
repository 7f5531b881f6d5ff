"""LoRA adapters served end to end: `triode serve --enable-lora` on the default model in float32,
random adapters made with `peft` in the test, the `openai` client picking them by `model`, and
transformers + peft on the same weights, in the same run, as the reference."""

from __future__ import annotations

import functools
import json
import shutil
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server import Server, running_server

from triode.gpu.loader import transformers_directory

pytestmark = pytest.mark.slow

KEY = "lora-key"
BASE = "smol"
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
)
MAX_TOKENS = 10
# long enough to fill several KV blocks of 16 tokens
LONG_PROMPT = "Write a short story about a lighthouse keeper who finds a map. " * 4

# name -> (rank, targets, rsLoRA, seed): made with peft at the start of the module
ADAPTERS: dict[str, tuple[int, list[str] | str, bool, int]] = {
    "all16": (16, "all-linear", False, 1),
    "qv8": (8, ["q_proj", "v_proj"], False, 2),
    "mlp8rs": (8, ["gate_proj", "up_proj", "down_proj", "o_proj"], True, 3),
    "all16-new": (16, "all-linear", False, 4),  # all16's shapes, other weights
    "rank32": (32, ["q_proj"], False, 5),  # over --max-lora-rank 16
    "head": (8, ["lm_head"], False, 6),  # a target triode does not take
}
AT_START = ("all16", "qv8")  # --lora-modules; the others are loaded at run time


def _peft():  # type: ignore[no-untyped-def]
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    return peft, torch, AutoModelForCausalLM


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each adapter of `ADAPTERS` saved by peft: B random (peft starts it at zero), scaled so
    that the outputs move but stay text."""
    peft, torch, auto = _peft()
    root = tmp_path_factory.mktemp("adapters")
    base = auto.from_pretrained(transformers_directory(model_dir), dtype=torch.float32)
    paths = {}
    for name, (rank, targets, rslora, seed) in ADAPTERS.items():
        config = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora,
            lora_dropout=0.0, task_type="CAUSAL_LM",
        )  # fmt: skip
        with warnings.catch_warnings():
            # the lm_head adapter: peft warns that the model ties it to the embedding
            warnings.simplefilter("ignore", UserWarning)
            tuned = peft.get_peft_model(base, config)
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for module_name, parameter in tuned.named_parameters():
                    if "lora_" in module_name:
                        std = 0.05 if "lora_B" in module_name else 0.1
                        parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
            paths[name] = root / name
            tuned.save_pretrained(paths[name])
        base = tuned.unload()
    return paths


class PeftReference:
    """transformers + peft on the default model with every adapter loaded; greedy decoding
    recomputed from the whole sequence at each token, one adapter (or none) at a time."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path]) -> None:
        peft, self.torch, auto = _peft()
        base = auto.from_pretrained(
            transformers_directory(model_dir), dtype=self.torch.float32
        ).eval()
        first, *rest = (n for n in ADAPTERS if n not in ("rank32", "head"))
        self.model = peft.PeftModel.from_pretrained(base, adapters[first], adapter_name=first)
        for name in rest:
            self.model.load_adapter(adapters[name], adapter_name=name)
        self.model.eval()
        self._lock = threading.Lock()

    @functools.cache  # noqa: B019 - the reference lives for the module
    def greedy(self, adapter: str | None, prompt_ids: tuple[int, ...]) -> list[int]:
        torch = self.torch
        ids = list(prompt_ids)
        with self._lock, torch.inference_mode():
            if adapter is None:
                with self.model.disable_adapter():
                    return self._decode(ids)
            self.model.set_adapter(adapter)
            return self._decode(ids)

    def logprobs(self, adapter: str, prompt_ids: list[int], output: list[int]) -> list[float]:
        """The log-probability the adapter gives each token of `output` after the prompt."""
        torch = self.torch
        ids = prompt_ids + output
        with self._lock, torch.inference_mode():
            self.model.set_adapter(adapter)
            logits = self.model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1 : -1]
        rows = torch.log_softmax(logits.float(), dim=-1)
        return [float(rows[i, token]) for i, token in enumerate(output)]

    def _decode(self, ids: list[int]) -> list[int]:
        start = len(ids)
        for _ in range(MAX_TOKENS):
            logits = self.model(self.torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        return ids[start:]


@pytest.fixture(scope="module")
def peft_reference(model_dir: Path, adapters: dict[str, Path]) -> PeftReference:
    return PeftReference(model_dir, adapters)


@pytest.fixture(scope="module")
def runtime_dir(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one directory run-time loads may read from (`--allowed-lora-paths`)."""
    allowed = tmp_path_factory.mktemp("allowed")
    for name in ADAPTERS:
        shutil.copytree(adapters[name], allowed / name)
    return allowed


def _server_args(adapters: dict[str, Path], runtime_dir: Path, *extra: str) -> list[str]:
    modules = [f"{name}={adapters[name]}" for name in AT_START]
    return [
        "--dtype", "float32", "--api-key", KEY, "--served-model-name", BASE,
        "--max-model-len", "1024", "--kv-cache-memory", "128MiB", "--enable-lora",
        "--lora-modules", *modules, "--max-loras", "2", "--max-cpu-loras", "2",
        "--max-lora-rank", "16", "--enable-admin-api", "--allowed-lora-paths", str(runtime_dir),
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def server(
    adapters: dict[str, Path], runtime_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("lora-server") / "serve.log"
    with running_server(_server_args(adapters, runtime_dir), log) as s:
        yield s


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _complete(server: Server, model: str, prompt: str, **extra: Any) -> Any:
    return _client(server).completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )  # fmt: skip


def _ids(completion: Any) -> tuple[list[int], list[int]]:
    """(prompt token ids, output token ids) of a completion's only choice."""
    [choice] = completion.choices
    return choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]


def _admin(server: Server, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.url}{route}", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=120
    )


def _agrees(server: Server, reference: PeftReference, model: str, prompt: str) -> None:
    completion = _complete(server, model, prompt)
    assert completion.model == model
    prompt_ids, output = _ids(completion)
    adapter = None if model == BASE else model
    assert output == reference.greedy(adapter, tuple(prompt_ids)), (model, prompt)


def test_adapters_alone_and_mixed_with_the_base_equal_transformers_and_peft(
    server: Server, peft_reference: PeftReference
) -> None:
    """Every prompt on the base and on each adapter, all at once (two adapters and the base in
    the same steps), then each adapter's prompts alone: token for token peft's greedy output."""
    cases = [(model, prompt) for model in (BASE, *AT_START) for prompt in PROMPTS]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda c: _complete(server, *c), cases))
    outputs = {}
    for (model, prompt), completion in zip(cases, results, strict=True):
        prompt_ids, output = _ids(completion)
        adapter = None if model == BASE else model
        assert output == peft_reference.greedy(adapter, tuple(prompt_ids)), (model, prompt)
        outputs[model, prompt] = output
    # the adapters change what the model says
    assert all(outputs[BASE, p] != outputs["all16", p] for p in PROMPTS)
    for prompt in PROMPTS[:1]:
        _agrees(server, peft_reference, "qv8", prompt)


def test_an_adapter_s_logprobs_are_peft_s(server: Server, peft_reference: PeftReference) -> None:
    completion = _complete(server, "qv8", PROMPTS[1], logprobs=1)
    prompt_ids, output = _ids(completion)
    got = completion.choices[0].logprobs.token_logprobs
    want = peft_reference.logprobs("qv8", prompt_ids, output)
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-3


def test_structured_output_and_tools_run_on_an_adapter(server: Server) -> None:
    """A JSON schema and a forced tool call hold whatever the adapter would rather say."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    answer = _client(server).chat.completions.create(
        model="all16", messages=[{"role": "user", "content": "Name a city."}], max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )  # fmt: skip
    assert answer.model == "all16"
    assert set(json.loads(answer.choices[0].message.content)) == {"city"}
    tool = {
        "type": "function",
        "function": {"name": "weather", "parameters": schema},
    }
    forced = {"type": "function", "function": {"name": "weather"}}
    called = _client(server).chat.completions.create(
        model="qv8", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40,
        temperature=0, tools=[tool], tool_choice=forced,
    )  # fmt: skip
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "weather" and set(json.loads(call.function.arguments)) == {"city"}


def test_models_lists_each_adapter_under_the_base(server: Server, adapters: dict) -> None:
    cards = {card.id: card for card in _client(server).models.list().data}
    assert set(AT_START) <= set(cards) and BASE in cards
    for name in AT_START:
        assert cards[name].model_extra["parent"] == BASE
        assert cards[name].model_extra["root"] == str(adapters[name])


def test_adapters_loaded_at_run_time_past_max_cpu_loras_are_evicted_and_reloaded(
    server: Server, peft_reference: PeftReference, runtime_dir: Path
) -> None:
    """A third adapter with room for two on the ranks: using them in turn evicts the least
    recently used and loads it back, each answer still peft's; an unloaded one is a 404."""
    response = _admin(
        server, "/v1/load_lora_adapter",
        {"lora_name": "mlp8rs", "lora_path": str(runtime_dir / "mlp8rs")},
    )  # fmt: skip
    assert response.status_code == 200, response.text
    for model in ("mlp8rs", "all16", "qv8", "mlp8rs", "qv8"):
        _agrees(server, peft_reference, model, PROMPTS[0])

    assert _admin(server, "/v1/unload_lora_adapter", {"lora_name": "mlp8rs"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(server, "mlp8rs", PROMPTS[0])
    assert "mlp8rs" not in {card.id for card in _client(server).models.list().data}


def _cached_tokens(completion: Any) -> int:
    details = completion.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def test_an_adapter_reloaded_with_new_weights_never_reuses_its_old_kv(
    server: Server, peft_reference: PeftReference, runtime_dir: Path
) -> None:
    """The same long prompt: shared within one adapter's content, never across the base, two
    adapters, or an adapter's new content under the same name (whose outputs are the new
    weights')."""
    prompt = f"{LONG_PROMPT} (reload)"
    load = {"lora_name": "again", "lora_path": str(runtime_dir / "all16")}
    assert _admin(server, "/v1/load_lora_adapter", load).status_code == 200
    assert _cached_tokens(_complete(server, "again", prompt)) == 0
    assert _cached_tokens(_complete(server, "again", prompt)) > 0  # its own blocks
    assert _cached_tokens(_complete(server, BASE, prompt)) == 0
    assert _cached_tokens(_complete(server, "qv8", prompt)) == 0
    # the same content under another name shares them: the digest names the KV, not the name
    assert _cached_tokens(_complete(server, "all16", prompt)) > 0

    load = {**load, "lora_path": str(runtime_dir / "all16-new"), "load_inplace": True}
    response = _admin(server, "/v1/load_lora_adapter", load)
    assert response.status_code == 200, response.text
    fresh = _complete(server, "again", prompt)
    assert _cached_tokens(fresh) == 0
    prompt_ids, output = _ids(fresh)
    assert output == peft_reference.greedy("all16-new", tuple(prompt_ids))
    assert output != peft_reference.greedy("all16", tuple(prompt_ids))
    assert _admin(server, "/v1/unload_lora_adapter", {"lora_name": "again"}).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"lora_name": "rank32", "lora_path": "{dir}/rank32"}, 400, "rank"),
        ({"lora_name": "head", "lora_path": "{dir}/head"}, 400, "lm_head"),
        ({"lora_name": "gone", "lora_path": "{dir}/missing"}, 400, "not a directory"),
        ({"lora_name": "outside", "lora_path": "/tmp"}, 400, "allowed-lora-paths"),
        ({"lora_name": BASE, "lora_path": "{dir}/all16-new"}, 400, BASE),
        ({"lora_name": "qv8", "lora_path": "{dir}/all16-new"}, 400, "already"),
    ],
    ids=["rank", "target", "missing", "outside", "base-name", "loaded"],
)
def test_what_cannot_be_loaded_is_a_400_naming_the_problem(
    server: Server, runtime_dir: Path, body: dict[str, str], status: int, words: str
) -> None:
    body = {k: v.format(dir=runtime_dir) for k, v in body.items()}
    response = _admin(server, "/v1/load_lora_adapter", body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]
    assert body["lora_name"] in {"qv8", BASE} or body["lora_name"] not in {
        card.id for card in _client(server).models.list().data
    }


def test_unloading_an_unknown_adapter_is_a_404(server: Server) -> None:
    response = _admin(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert response.status_code == 404, response.text


def test_an_adapter_unloaded_while_a_stream_uses_it_lets_the_stream_finish(
    server: Server, runtime_dir: Path
) -> None:
    response = _admin(
        server, "/v1/load_lora_adapter",
        {"lora_name": "later", "lora_path": str(runtime_dir / "all16-new")},
    )  # fmt: skip
    assert response.status_code == 200, response.text
    stream = _client(server).completions.create(
        model="later", prompt=PROMPTS[2], max_tokens=120, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    first = next(chunks)
    assert first.model == "later"
    assert _admin(server, "/v1/unload_lora_adapter", {"lora_name": "later"}).status_code == 200
    rest = list(chunks)
    finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    with pytest.raises(openai.NotFoundError):
        _complete(server, "later", PROMPTS[0])


def test_two_tensor_parallel_ranks_serve_an_adapter_as_one_does(
    server: Server,
    adapters: dict[str, Path],
    runtime_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    log = tmp_path_factory.mktemp("lora-tp") / "serve.log"
    with running_server(_server_args(adapters, runtime_dir, "-tp", "2"), log) as tp:
        for model in ("all16", "qv8", BASE):
            one = _ids(_complete(server, model, PROMPTS[1]))
            two = _ids(_complete(tp, model, PROMPTS[1]))
            assert one == two, model
