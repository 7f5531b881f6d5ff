"""The generation endpoints: `/v1/chat/completions` and `/v1/completions`.

A request is validated, templated and tokenized (the intake), then each of its prompts runs as
one `Engine.generate` in delta mode (`generation.py`), its answer sent whole or as an SSE stream
(`streams.py`).
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import msgspec
import trio

from triode.actors import transfer_params_error
from triode.wire import SamplingParams, StructuredOutputsParams, kv_seal

from ..errors import APIError, check_engine_alive, validation_error
from ..http import Request, respond_json
from ..tenancy import request_cache_salt
from ..tools.choice import template_renders_tools
from .chat_tools import CallReaders, ChatTools, tool_message
from .generation import Generation, Prompt, prompt_token_ids, usage_of, weight_version_of
from .logprobs import chat_logprobs, completion_logprobs
from .prompt_embeds import decode_prompt_embeds
from .request_bodies import ChatCompletionRequest, CompletionRequest, decode_request
from .response_bodies import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessageOut,
    CompletionResponse,
    CompletionResponseChoice,
)
from .sampling import sampling_params
from .streams import ChatStream, CompletionStream, stream
from .structured import check_structured, structured_from_grammar, structured_outputs_of


class Serving(Generation):
    """The chat and completions handlers over one engine."""

    # Chat

    async def chat(self, request: Request) -> None:
        body = await request.read_body(self.settings.max_body_size)
        req = decode_request(body, ChatCompletionRequest, request)
        lora_name = await self.loras.pick(req.model)
        check_engine_alive(self.engine)
        self.check_choices(req, 1)
        messages = msgspec.to_builtins(req.messages)
        tools = ChatTools.of(req, messages)
        structured = await _structured(req)
        if tools is not None and tools.grammar is not None:
            if structured is not None:
                raise APIError(
                    400,
                    "tool_choice: a required or named tool choice cannot be combined with "
                    "a structured output constraint",
                    param="tool_choice",
                )
            structured = structured_from_grammar(tools.grammar)
        token_ids = await self.chat_token_ids(req, messages, tools)
        params = sampling_params(
            req,
            prompt_len=len(token_ids),
            max_model_len=self.engine.max_model_len,
            structured_outputs=structured,
            defaults=self.engine.generation_defaults,
        )
        self.check_token_ids(params=params)
        prompts = [Prompt(token_ids, None, lora_name=lora_name)]
        self.check_logprobs_volume(req, prompts, params)
        self._salt(request, req.cache_salt, prompts)
        req.kv_transfer_params = _transfer_params(
            self.engine, request, req.kv_transfer_params, prompts, params
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            chat_stream = ChatStream(self, req, request_id, prompts[0], tools)
            await stream(
                self, request, prompts, params, request_id, chat_stream, req.kv_transfer_params,
                stop_when=chat_stream.ended if chat_stream.parsers else None,
            )  # fmt: skip
            return
        readers = None if tools is None or not tools.calls else CallReaders(tools.tools, params.n)
        await self.generate(
            request, prompts, params, request_id, None, req.kv_transfer_params, stop_when=readers
        )
        prompt = prompts[0]
        token_ids, as_ids = bool(req.return_token_ids), bool(req.return_tokens_as_token_ids)
        choices = []
        for c in prompt.choices:
            message, finish_reason = ChatMessageOut(content=c.text), c.finish_reason
            if readers is not None:
                message, finish_reason = tool_message(readers.of[c.index], c.finish_reason)
            logprobs = chat_logprobs(self.engine, c.logprobs, req.top_logprobs or 0, as_ids=as_ids)
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if token_ids else None,
                )
            )
        response = ChatCompletionResponse(
            id=request_id,
            model=req.model or self.model_name,
            choices=choices,
            usage=usage_of(prompts),
            kv_transfer_params=prompt.kv_transfer_params,
            prompt_token_ids=prompt_token_ids(req, prompt),
            weight_version=weight_version_of(prompts),
        )
        await respond_json(request.send, response)

    async def chat_token_ids(
        self, req: ChatCompletionRequest, messages: list[Any], tools: ChatTools | None
    ) -> list[int]:
        """The prompt's token ids: the messages (with the tools, as the template takes them)
        through the chat template."""
        template_kwargs = req.chat_template_kwargs
        if tools is not None:
            template = self.engine.intake.chat_template
            renders = template is not None and template_renders_tools(template.source)
            messages, extra = tools.prepare(messages, renders_tools=renders)
            template_kwargs = {**extra, **(template_kwargs or {})}
        try:
            _, token_ids = await self.engine.intake.encode_chat(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=req.add_special_tokens,
                template_kwargs=template_kwargs,
            )
        except ValueError as e:
            raise validation_error(e) from e
        return token_ids

    async def render_chat(self, request: Request) -> None:
        """`POST /v1/chat/completions/render`: the token ids a chat request's prompt would run
        as, without running it (what vllm-router's `kv_aware` matches cached blocks by)."""
        body = await request.read_body(self.settings.max_body_size)
        req = decode_request(body, ChatCompletionRequest, request)
        await self.loras.pick(req.model)  # an adapter renders as its base model does
        messages = msgspec.to_builtins(req.messages)
        token_ids = await self.chat_token_ids(req, messages, ChatTools.of(req, messages))
        await respond_json(request.send, {"token_ids": token_ids, "features": None})

    async def render_completions(self, request: Request) -> None:
        """`POST /v1/completions/render`: each prompt's token ids, in order (prompts given as
        embeddings have none: a 400)."""
        body = await request.read_body(self.settings.max_body_size)
        req = decode_request(body, CompletionRequest, request)
        await self.loras.pick(req.model)
        if req.prompt_embeds is not None:
            raise APIError(400, "prompt_embeds: have no token ids", param="prompt_embeds")
        self.check_choices(req, len(req.prompts()))
        rendered = [{"token_ids": p.token_ids, "features": None} for p in await self._prompts(req)]
        await respond_json(request.send, rendered)

    # Completions

    async def completions(self, request: Request) -> None:
        body = await request.read_body(self.settings.max_body_size)
        req = decode_request(body, CompletionRequest, request)
        lora_name = await self.loras.pick(req.model)
        check_engine_alive(self.engine)
        # before any prompt costs a decode or a tokenization
        self.check_choices(req, len(req.embeds_prompts()) + len(req.prompts()))
        intake = self.engine.intake
        prompts = await self._embeds_prompts(req) + await self._prompts(req)
        if any(not p.token_ids for p in prompts):
            raise APIError(400, "prompt: must not be empty", param="prompt")
        longest = max(prompts, key=lambda p: len(p.token_ids))
        params = sampling_params(
            req,
            prompt_len=len(longest.token_ids),
            max_model_len=self.engine.max_model_len,
            structured_outputs=await _structured(req),
            defaults=self.engine.generation_defaults,
        )
        self.check_token_ids(params=params)
        self.check_logprobs_volume(req, prompts, params)
        req.kv_transfer_params = _transfer_params(
            self.engine, request, req.kv_transfer_params, prompts, params
        )
        self._salt(request, req.cache_salt, prompts)
        for prompt in prompts:
            prompt.lora_name = lora_name
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if req.echo:
            for p in prompts:
                if p.text is None:
                    p.text = await intake.decode(p.token_ids, skip_special_tokens=False)
        if req.stream:
            completion_stream = CompletionStream(self, req, request_id, prompts)
            await stream(
                self, request, prompts, params, request_id, completion_stream,
                req.kv_transfer_params,
            )  # fmt: skip
            return
        await self.generate(request, prompts, params, request_id, None, req.kv_transfer_params)
        choices = []
        for i, prompt in enumerate(prompts):
            for c in prompt.choices:
                echo = prompt.text if req.echo and prompt.text else ""
                choices.append(
                    CompletionResponseChoice(
                        index=i * params.n + c.index,
                        text=echo + c.text,
                        logprobs=completion_logprobs(self.engine, prompt, c, req, echo=bool(echo)),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_token_ids=prompt_token_ids(req, prompt),
                        token_ids=c.token_ids if req.return_token_ids else None,
                    )
                )
        response = CompletionResponse(
            id=request_id,
            model=req.model or self.model_name,
            choices=choices,
            usage=usage_of(prompts),
            kv_transfer_params=prompts[0].kv_transfer_params,
            weight_version=weight_version_of(prompts),
        )
        await respond_json(request.send, response)

    async def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        """The prompts given as text (tokenized) or token ids (checked against the
        vocabulary), in order."""
        prompts = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = await self.engine.intake.encode(p, add_special_tokens=req.add_special_tokens)
                prompts.append(Prompt(ids, p))
            else:
                self.check_token_ids(prompt=p, prompt_field="prompt")
                prompts.append(Prompt(list(p), None))
        return prompts

    async def _embeds_prompts(self, req: CompletionRequest) -> list[Prompt]:
        """The prompts given as embeddings, decoded off the event loop. Raises a 400 for a
        payload that is not one, or for options that need the prompt's tokens."""
        payloads = req.embeds_prompts()
        if not payloads:
            return []
        for name, value in (
            ("echo", req.echo),
            ("prompt_logprobs", req.prompt_logprobs is not None),
            ("kv_transfer_params", req.kv_transfer_params),
        ):
            if value:
                raise APIError(400, f"{name}: not supported with prompt_embeds", param=name)
        decode = functools.partial(
            decode_prompt_embeds,
            hidden_size=self.engine.hidden_size,
            max_model_len=self.engine.max_model_len,
            max_bytes=self.settings.max_body_size,
        )
        # each choice gets its own copy in shared memory: n copies count n times
        copies, budget = req.n or 1, self.settings.max_prompt_embeds_bytes
        prompts, total = [], 0
        for payload in payloads:
            embeds = await trio.to_thread.run_sync(decode, payload)
            total += embeds.nbytes * copies
            if total > budget:
                raise APIError(
                    400,
                    f"prompt_embeds: {total} bytes or more once decoded, counted once per "
                    f"choice; this server takes at most {budget} in one request",
                    param="prompt_embeds",
                )
            prompts.append(Prompt([0] * len(embeds), None, embeds=embeds))
        return prompts

    def _salt(self, request: Request, cache_salt: str | None, prompts: list[Prompt]) -> None:
        """Give the prompts the salt their KV blocks are hashed with: the request's own
        `cache_salt`, and the caller's key under `--prefix-cache-isolation key`."""
        isolation = self.settings.prefix_cache_isolation
        salt = request_cache_salt(isolation, request.key_digest, cache_salt)
        for prompt in prompts:
            prompt.cache_salt = salt


async def _structured(
    req: ChatCompletionRequest | CompletionRequest,
) -> StructuredOutputsParams | None:
    found = structured_outputs_of(req)
    if found is None:
        return None
    field, so = found
    await check_structured(so, param=field)
    return so


def seal_for_caller(
    engine: Any, request: Request, params: dict[str, Any] | None
) -> dict[str, Any] | None:
    """`params` sealed by this instance where it takes an authenticated caller's word for a
    hold: a `do_remote_decode` without the proxy's seal (vllm-router's prefill leg sends one,
    its other fields null), on a prefill whose KV config says `unsealed_holds: authenticated`,
    from a request that passed the API-key check. Such a hold costs what a proxy's does: the
    prompt's blocks, for at most `hold_timeout`, within `max_hold_fraction` of the cache, past
    which the request finishes without one. Anything else is left as it came."""
    if (
        not params
        or params.get("do_remote_decode") is not True
        or kv_seal.SEAL in params
        or engine.kv_secret is None
        or engine.kv_unsealed_holds != "authenticated"
        or request.key_digest is None
    ):
        return params
    asked = {key: value for key, value in params.items() if value is not None}
    return kv_seal.seal_remote_decode(engine.kv_secret, asked)


def _transfer_params(
    engine: Any,
    request: Request,
    params: dict[str, Any] | None,
    prompts: list[Prompt],
    sampling: SamplingParams,
) -> dict[str, Any] | None:
    """The request's `kv_transfer_params` as the engine takes them (`seal_for_caller`); a 400
    for ones of the wrong shape, or on a request that is not one generation (one prompt,
    n = 1): a transfer hands on one sequence's KV."""
    params = seal_for_caller(engine, request, params)
    if not params:
        return params
    problem = transfer_params_error(params)
    if problem is None and (len(prompts) != 1 or sampling.n != 1):
        problem = "kv_transfer_params: work with one prompt and n = 1 only"
    if problem is not None:
        raise APIError(400, problem, param="kv_transfer_params")
    return params
