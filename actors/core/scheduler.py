"""The engine core's scheduling policy: which tokens of which requests the next step computes.

vLLM V1's rule: there is no prefill or decode phase, only requests whose computed tokens lag
behind their known tokens. Each step spends a token budget catching them up: running requests
first (preempting the lowest-priority, newest one by recompute when blocks run out), then
waiting ones, whose prompts are cut into budget-sized chunks. New requests start with at most
`max_new_prompt_tokens` of prompt between them a step (the first one always starts): a burst of
short prompts spreads over a few steps, so its first requests answer sooner, while a lone long
prompt still takes the whole budget. With a KV connector
(`kv_connector.py`) a waiting request may instead load its prompt's KV from another instance,
and a finished one may keep its blocks until another instance has read them (`kv_transfers.py`
keeps those blocks). Pure Python; the runner and the engine loop live elsewhere.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from triode.wire.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from triode.wire.step import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)

from ..prompt_embeds import embeds_error
from .admission import prompt_error, task_error
from .kv_cache import KVCacheBlock, KVCacheManager, hash_root
from .kv_connector import KVConnectorScheduler
from .kv_events import KVEventLog
from .kv_transfers import KVTransfers
from .request import Request, RequestStatus
from .scheduler_config import SchedulerConfig
from .scheduler_stats import scheduler_stats
from .step_results import apply_result

if TYPE_CHECKING:
    from .loras import LoRAEntry, LoRARegistry
    from .speculation.drafter import Drafter
    from .structured_output import Grammar, StructuredOutputManager


class Scheduler:
    """Owns the requests and the KV block accounting of one engine core. Not thread-safe: the
    engine calls it from one thread, and the runner works only on the `SchedulerOutput`."""

    def __init__(
        self,
        config: SchedulerConfig,
        connector: KVConnectorScheduler | None = None,
        structured: StructuredOutputManager | None = None,
        drafter: Drafter | None = None,
        kv_events: KVEventLog | None = None,
    ) -> None:
        self.config = config
        # speculative decoding: which running requests propose tokens to verify each step
        self.drafter = drafter
        self.connector = connector
        if connector is not None:
            connector.num_blocks = config.num_blocks  # what its holds may take a share of
        self.structured = structured
        self.kv_cache = KVCacheManager(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            events=kv_events,
        )
        # A sequence can never outgrow the whole cache: past that, the oldest request would
        # preempt itself forever. So the cache size caps the length like max_model_len does.
        self.max_len = min(config.max_model_len, config.num_blocks * config.block_size)
        self.requests: dict[str, Request] = {}  # live: waiting or running
        # Both queues are sorted by `Request.sort_key`: the head is served first, the tail of
        # `running` is the preemption victim. With equal priorities that is FCFS and
        # "preempt the newest", and a preempted request goes back to the front of `waiting`.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._step = 0
        self._seq = 0
        self._runner_forget: list[str] = []  # for the next SchedulerOutput that has work
        self._aborted: defaultdict[int, list[str]] = defaultdict(list)  # for the next update
        self._in_flight: dict[int, dict[str, tuple[Request, ScheduledRequest]]] = {}
        # the KV connector's loads and holds, and their blocks
        self.transfers = None if connector is None else KVTransfers(connector, self.kv_cache)
        self.prompt_tokens_computed = 0  # prompt positions scheduled for the forward
        # False while paused with `wait`: only requests that already started are scheduled
        self.admitting = True
        # the weights' version, which every output carries (`EngineCoreOutput.weight_version`)
        self.weight_version = 0
        # the engine core's LoRA adapters: which of them a step may run (`LoRARegistry.admits`)
        self.loras: LoRARegistry | None = None

    # Intake

    def add_request(
        self,
        request: EngineCoreRequest,
        grammar: Grammar | None = None,
        prompt_embeds: np.ndarray | None = None,
        lora: LoRAEntry | None = None,
    ) -> EngineCoreOutput | None:
        """Queue a request, or return the error output that finishes it at once when it could
        never run: a queued request that can never be scheduled would wait forever.

        A request with structured outputs comes with its compiled `grammar`, one whose prompt
        came as embeddings with them (`prompt_embeds`, out of shared memory already), one run
        with a LoRA adapter with its registry entry (`lora`, resolved by the engine core)."""
        error = self._admission_error(request)
        if error is None and (request.sampling_params.structured_outputs is None) != (
            grammar is None
        ):
            error = "structured_outputs: the request and its compiled grammar must come together"
        if error is None:
            error = embeds_error(request, prompt_embeds)
        if error is not None:
            return EngineCoreOutput(
                request.request_id, finish_reason=FinishReason.ERROR, stop_reason=error
            )
        if self.waiting_full():
            return self.refusal(request.request_id)
        if self.connector is not None:
            busy = self.connector.admit_load(request.request_id, request.kv_transfer_params)
            if busy is not None:
                return EngineCoreOutput(
                    request.request_id, finish_reason=FinishReason.REFUSED, stop_reason=busy
                )
        root = None
        if self.config.enable_prefix_caching:
            root = hash_root(request, prompt_embeds, None if lora is None else lora.digest)
        req = Request.from_engine_core_request(request, self._seq, prompt_embeds, root, lora)
        req.grammar = grammar
        self._seq += 1
        self.requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=_sort_key)
        if self.connector is not None:
            self.connector.request_added(req)
        return None

    def waiting_full(self, pending: int = 0) -> bool:
        """Whether a new request would pass `max_waiting_requests`, with `pending` more on
        their way in (grammars compiling)."""
        bound = self.config.max_waiting_requests
        return bool(bound) and len(self.waiting) + pending >= bound

    def refusal(self, request_id: str) -> EngineCoreOutput:
        """The output that refuses a request for now: the queue of waiting ones is full."""
        return EngineCoreOutput(
            request_id,
            finish_reason=FinishReason.REFUSED,
            stop_reason=f"the server is busy: {len(self.waiting)} requests are waiting to start "
            f"(at most {self.config.max_waiting_requests}); try again later",
        )

    def _admission_error(self, request: EngineCoreRequest) -> str | None:
        if request.request_id in self.requests or request.request_id in self.held:
            return f"request id {request.request_id!r} is already in use by a live request"
        if request.request_id in self.loading:  # aborted, its blocks still being written
            return f"request id {request.request_id!r} is still in use by an aborted request"
        return task_error(self.config, request) or prompt_error(self.config, self.max_len, request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests at once and free all their blocks. Idempotent; unknown ids are
        ignored (the request may have finished on its own meanwhile)."""
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                # finished, its blocks kept for another instance: abort frees them too
                if self.transfers is not None:
                    self.transfers.drop_hold(request_id)
                continue
            if self.connector is not None:
                self.connector.cancel_load(request_id)
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                # its load stops, but its blocks stay until every rank is through writing
                # them (`KVTransfers.update`)
                req.status = RequestStatus.FINISHED_ABORTED
                req.release_lora()
                del self.requests[request_id]
            else:
                queue = self.running if req.status is RequestStatus.RUNNING else self.waiting
                queue.remove(req)
                self.finish(req, RequestStatus.FINISHED_ABORTED)
            self._aborted[req.client_index].append(request_id)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a live request the caller took out of its queue: its blocks and adapter go."""
        req.status = status
        req.release_lora()
        del self.requests[req.request_id]
        if self.transfers is not None:  # it may hold its prompt's blocks for another instance
            self.transfers.finish(req)
        else:
            self.kv_cache.free(req)
        if self.drafter is not None:
            self.drafter.stop(req)
        if req.runner_knows:
            self._runner_forget.append(req.request_id)

    # The step

    def schedule(self, *, max_requests: int | None = None, preempt: bool = True) -> SchedulerOutput:
        """Pick this step's tokens under the token budget and `max_num_seqs`, allocating their
        blocks; each picked request's `num_computed_tokens` already counts them on return.

        A request whose last step is still in flight has no token to compute and is skipped,
        so steps can be scheduled while earlier ones run (the pipeline-parallel batch queue);
        `max_requests` caps this step's requests, which splits the running ones into
        micro-batches. Without `preempt`, a request that finds no free block waits for one
        instead of preempting: a request in flight must keep its blocks.
        """
        if self.transfers is not None:
            self.transfers.expire_holds()
        budget = self.config.max_num_batched_tokens
        room = max_requests if max_requests is not None else self.config.max_num_seqs
        scheduled: list[tuple[Request, int, list[int]]] = []
        preempted = False
        planned = {} if self.drafter is None else self.drafter.plan(self.running, self.max_len)

        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < room:
            req = self.running[i]
            num_new = min(
                req.num_tokens - req.num_computed_tokens,
                budget,
                self.max_len - req.num_computed_tokens,
            )
            if num_new <= 0:  # still waiting for the token it sampled last step
                i += 1
                continue
            drafts = planned.get(req.request_id, [])[: budget - num_new] if num_new == 1 else []
            # proposals take only blocks that are free: they never preempt anyone
            if drafts and self.kv_cache.allocate_slots(req, num_new + len(drafts)) is None:
                drafts = []
            while not drafts and self.kv_cache.allocate_slots(req, num_new) is None:
                if not preempt:
                    # wait for blocks to come free, admitting nobody who would take them
                    return self._build_output(scheduled)
                victim = self.running.pop()  # never scheduled yet: it comes after `req`
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new, drafts))
                budget -= num_new + len(drafts)
                i += 1

        # New admissions would only take blocks that the preempted requests need back.
        limit, new_prompt_tokens = self.config.max_new_prompt_tokens, 0
        adapters = set() if self.loras is None else self.loras.active(self.running)
        while (
            not preempted
            and self.waiting
            and len(self.running) < self.config.max_num_seqs
            and budget > 0
            and len(scheduled) < room
        ):
            head = self._admissible(adapters)
            if head is None:
                break
            req = self.waiting[head]
            if req.num_computed_tokens:  # its prompt's KV was loaded into blocks it holds
                hit_blocks, num_hit = [], req.num_computed_tokens
            else:
                hit_blocks = self.kv_cache.get_computed_blocks(req)
                num_hit = len(hit_blocks) * self.config.block_size
                if self.transfers is not None:
                    connector = self.transfers.connector
                    num_external, load = connector.get_num_new_matched_tokens(req, num_hit)
                    if num_external and load:
                        if not self.transfers.start_load(req, hit_blocks, num_external):
                            break
                        self.waiting.pop(head)  # parked until its KV is loaded
                        continue
            num_new = min(req.num_tokens - num_hit, budget)
            if self.config.whole_prompts and num_new < req.num_tokens - num_hit:
                break  # an encoder's prompt is never split: the next step starts it
            if limit and new_prompt_tokens and new_prompt_tokens + num_new > limit:
                break  # the next step starts it
            if self.kv_cache.allocate_slots(req, num_new, hit_blocks) is None:
                break  # head-of-line blocking keeps the order fair
            self.waiting.pop(head)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            bisect.insort(self.running, req, key=_sort_key)
            scheduled.append((req, num_new, []))
            budget -= num_new
            new_prompt_tokens += num_new

        return self._build_output(scheduled)

    def _admissible(self, adapters: set[int]) -> int | None:
        """The index in `waiting` of the next request to start: the first (while not
        `admitting`, the first that had started before, preempted since) whose LoRA adapter
        may run in this step beside those of `adapters` (`LoRARegistry.admits`, which adds
        it); one whose adapter may not waits, and the requests behind it go ahead."""
        for i, r in enumerate(self.waiting):
            if (self.admitting or r.num_preemptions) and (
                r.lora is None or self.loras is None or self.loras.admits(r.lora, adapters)
            ):
                return i
        return None

    def started_requests(self) -> int:
        """Requests that started and have not finished: running, or preempted and waiting to
        run again."""
        return len(self.running) + sum(1 for r in self.waiting if r.num_preemptions)

    def preempt_all(self) -> int:
        """Preempt every running request (their KV is about to go away): each waits to be
        computed again. Only between steps. Returns how many."""
        victims, self.running = self.running, []
        for req in victims:
            self._preempt(req)
        return len(victims)

    def abort_all(self) -> list[tuple[int, EngineCoreOutput]]:
        """Abort every live request. Returns what tells each one's client, (client index,
        output with finish reason `abort`), for the caller to send at once: an abort the
        client did not ask for must reach it."""
        live = list(self.requests.values())
        self.abort_requests([r.request_id for r in live])
        return [
            (r.client_index, EngineCoreOutput(r.request_id, finish_reason=FinishReason.ABORT))
            for r in live
        ]

    def _preempt(self, req: Request) -> None:
        """Recompute-only preemption: drop the request's KV cache and queue it again."""
        self.kv_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=_sort_key)

    def _build_output(self, scheduled: list[tuple[Request, int, list[int]]]) -> SchedulerOutput:
        self._step += 1
        out = SchedulerOutput(step=self._step)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        if scheduled:
            # An engine may skip the runner for an empty step; the ids must not get lost there.
            out.finished_request_ids, self._runner_forget = self._runner_forget, []
        in_flight = {}
        for req, num_new, drafts in scheduled:
            start = req.num_computed_tokens
            entry = ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.all_token_ids[start : start + num_new] + drafts,
                num_computed_tokens=start,
                block_ids=self.kv_cache.block_ids(req.request_id),
                sample=start + num_new == req.num_tokens,
                num_draft_tokens=len(drafts),
            )
            if not req.runner_knows:
                entry.new = NewRequestData(
                    req.prompt_token_ids,
                    req.sampling_params,
                    req.prompt_embeds_dtype,
                    req.lora_id,
                    req.pooling_params,
                )
                req.runner_knows = True
            if req.prompt_embeds is not None and start < req.num_prompt_tokens:
                entry.prompt_embeds = req.prompt_embeds[start : start + num_new]
            # Advance now, so a chunked prefill goes on next step without waiting for results
            # (past the proposals too: the result takes back those it rejects).
            req.num_computed_tokens = start + num_new + len(drafts)
            self.prompt_tokens_computed += max(
                0, min(start + num_new, req.num_prompt_tokens) - start
            )
            out.requests.append(entry)
            in_flight[req.request_id] = (req, entry)
            if entry.sample and req.grammar is not None:  # masked in fill_bitmask
                out.grammar_request_ids += [req.request_id] * (1 + len(drafts))
        if in_flight:
            self._in_flight[out.step] = in_flight
        return out

    def fill_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Fill the grammar bitmask of a step that has constrained rows (`grammar_request_ids`):
        what each of them may sample next. It is apart from `schedule` so that the engine core
        can run it in a thread while the runner computes the step's forward, which does not need
        it: nothing advances these grammars until the step's results come back."""
        if scheduler_output.grammar_bitmask is not None or not scheduler_output.grammar_request_ids:
            return
        assert self.structured is not None
        in_flight = self._in_flight[scheduler_output.step]
        constrained = dict.fromkeys(scheduler_output.grammar_request_ids)  # each request once
        grammars = [in_flight[rid][0].grammar for rid in constrained]
        drafts = [in_flight[rid][1].draft_token_ids for rid in constrained]
        scheduler_output.grammar_bitmask = self.structured.bitmask(grammars, drafts)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Take one step's results: append sampled tokens, apply stop conditions, finish and
        free what stopped. Returns what to publish, per client index."""
        in_flight = self._in_flight.pop(scheduler_output.step, {})
        if runner_output.kv_connector_output is not None:
            assert self.transfers is not None
            for req in self.transfers.update(runner_output.kv_connector_output):
                bisect.insort(self.waiting, req, key=_sort_key)  # its load is through
        outputs: defaultdict[int, list[EngineCoreOutput]] = defaultdict(list)
        finished: defaultdict[int, list[str]] = self._aborted
        self._aborted = defaultdict(list)
        for result in runner_output.results:
            req, entry = in_flight.get(result.request_id, (None, None))
            # Identity, not id: an id aborted during the step may already name a new request.
            if req is None or entry is None or req.is_finished:
                continue
            output = apply_result(self, req, entry, result)
            if output is None:
                continue
            outputs[req.client_index].append(output)
            if output.finish_reason is not None:
                finished[req.client_index].append(req.request_id)
        return {
            client: EngineCoreOutputs(
                outputs=outputs.get(client, []), finished_requests=finished.get(client) or None
            )
            for client in outputs.keys() | finished.keys()
        }

    # Queries

    @property
    def loading(self) -> dict[str, Request]:
        """Requests whose prompt KV is loading (`KVTransfers.loading`)."""
        return {} if self.transfers is None else self.transfers.loading

    @property
    def held(self) -> dict[str, list[KVCacheBlock]]:
        """Finished requests' blocks kept for another instance to read."""
        return {} if self.transfers is None else self.transfers.held

    @property
    def prompt_tokens_transferred(self) -> int:
        """Prompt positions loaded from another instance."""
        return 0 if self.transfers is None else self.transfers.prompt_tokens_transferred

    @property
    def kv_load_failures(self) -> int:
        return 0 if self.transfers is None else self.transfers.load_failures

    @property
    def kv_protocol_errors(self) -> int:
        return 0 if self.transfers is None else self.transfers.protocol_errors

    def waiting_tokens(self) -> int:
        """The prompt tokens of the requests waiting to start."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_transfers(self) -> bool:
        """Whether a KV transfer is outstanding: steps must go on, empty or not, for the
        workers to report it."""
        return self.connector is not None and self.connector.pending

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes, also those of blocks in use (`forget_prefixes`);
        returns how many."""
        return self.kv_cache.forget_prefixes()

    def get_stats(self) -> SchedulerStats:
        """A snapshot; the prefix-cache counters (tokens) and preemptions are cumulative."""
        return scheduler_stats(self)


def _sort_key(req: Request) -> tuple[int, int]:
    return req.sort_key
