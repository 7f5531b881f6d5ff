"""A minimal scheduler over a `ModelRunner` for the runner's tests: chunked prefill, decodes,
block allocation, preemption, each request's tokens and logprobs as they come; requests may name
a LoRA adapter the runner holds. And `teacher_forced`: a model's top predictions along a text."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from triode.gpu.model_runner import ModelRunner
from triode.wire import Logprobs, NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=None, logprobs=3)


@dataclass
class Seq:
    tokens: list[int]
    params: SamplingParams
    prompt_len: int
    lora_id: int = 0  # its LoRA adapter; 0: the base model
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    announced: bool = False
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs] = field(default_factory=list)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Driver:
    """A minimal scheduler: chunked prefill, decodes, block allocation, preemption."""

    def __init__(self, runner: ModelRunner, *, shuffle_blocks: bool = False) -> None:
        self.runner = runner
        self.free = list(range(runner.num_kv_blocks))
        if shuffle_blocks:
            random.Random(1).shuffle(self.free)
        self.seqs: dict[str, Seq] = {}
        self.step_count = 0
        self.finished: list[str] = []
        self.accepted = 0  # proposals the runner accepted

    def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams = GREEDY,
        lora_id: int = 0,
    ) -> None:
        self.seqs[request_id] = Seq(list(prompt), params, len(prompt), lora_id)

    def preempt(self, request_id: str) -> None:
        """Recompute from scratch later, in other blocks (the runner keeps the request)."""
        seq = self.seqs[request_id]
        self.free += seq.blocks
        seq.blocks, seq.computed = [], 0

    def finish(self, request_id: str) -> None:
        self.free += self.seqs.pop(request_id).blocks
        self.finished.append(request_id)

    def step(
        self,
        chunks: dict[str, int] | None = None,
        drafts: dict[str, list[int]] | None = None,
    ) -> None:
        """One step for every request; `chunks` caps a request's token count this step;
        `drafts` gives decoding requests proposals to verify (speculative decoding)."""
        scheduled = []
        for request_id, seq in self.seqs.items():
            n = min(len(seq.tokens) - seq.computed, (chunks or {}).get(request_id, 10**9))
            end = seq.computed + n
            proposed = (drafts or {}).get(request_id, []) if n == 1 else []
            while len(seq.blocks) * self.runner.block_size < end + len(proposed):
                seq.blocks.append(self.free.pop(0))
            new = None
            if not seq.announced:
                prompt = seq.tokens[: seq.prompt_len]
                new = NewRequestData(prompt, seq.params, lora_id=seq.lora_id)
            seq.announced = True
            scheduled.append(
                ScheduledRequest(
                    request_id,
                    seq.tokens[seq.computed : end] + proposed,
                    seq.computed,
                    list(seq.blocks),
                    sample=end == len(seq.tokens),
                    new=new,
                    num_draft_tokens=len(proposed),
                )
            )
        out = self.runner.execute(
            SchedulerOutput(self.step_count, scheduled, finished_request_ids=self.finished)
        )
        self.step_count, self.finished = self.step_count + 1, []
        for r in scheduled:
            self.seqs[r.request_id].computed += len(r.token_ids) - r.num_draft_tokens
        for result in out.results:
            seq = self.seqs[result.request_id]
            if result.token_id is not None:
                emitted = [*result.accepted_token_ids, result.token_id]
                seq.tokens += emitted
                seq.computed += len(result.accepted_token_ids)
                self.accepted += len(result.accepted_token_ids)
            if result.logprobs is not None:  # a row per emitted token
                lp = result.logprobs
                seq.logprobs += [
                    Logprobs(lp.token_ids[i : i + 1], lp.logprobs[i : i + 1], lp.ranks[i : i + 1])
                    for i in range(len(lp.ranks))
                ]
            if result.prompt_logprobs is not None:
                seq.prompt_logprobs.append(result.prompt_logprobs)

    def run(self, num_tokens: int, chunks: dict[str, int] | None = None) -> None:
        """Step until every request has `num_tokens` outputs; `chunks` caps prefill chunks."""
        while any(len(s.output) < num_tokens for s in self.seqs.values()):
            self.step(chunks)


def assert_greedy_as_transformers(seq: Seq, hf_model: object, steps: int) -> None:
    """`seq`'s first `steps` outputs are transformers' greedy `generate` after its prompt (EOS
    not stopping it), and every logprob the runner returned with them (the chosen token's and
    its top alternatives') is transformers' log-softmax within 1e-4."""
    import torch

    prompt = seq.tokens[: seq.prompt_len]
    with torch.inference_mode():
        out = hf_model.generate(  # type: ignore[attr-defined]
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert seq.output[:steps] == out.sequences[0, len(prompt) :].tolist()
    for logprobs, logits in zip(seq.logprobs[:steps], out.logits, strict=True):
        ids = torch.from_numpy(logprobs.token_ids[0]).long()
        theirs = logits[0].float().log_softmax(-1)[ids]
        ours = torch.from_numpy(logprobs.logprobs[0])
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def teacher_forced(
    runner: ModelRunner, tokens: list[int], copies: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-5 ids, top-5 logprobs) predicting each next token: the first token as a one-token
    prompt, then every later one fed as a decode step (the rows the quantized paths run), for
    `copies` requests decoding together; the last copy's."""
    params = SamplingParams(temperature=0.0, max_tokens=len(tokens), logprobs=5)
    ids, logprobs = [], []
    width = -(-len(tokens) // runner.block_size)
    for step, token in enumerate(tokens[:-1]):
        new = NewRequestData(tokens[:1], params) if step == 0 else None
        requests = [
            ScheduledRequest(
                f"r{i}", [token], step, list(range(i * width, (i + 1) * width)), new=new
            )
            for i in range(copies)
        ]
        result = runner.execute(SchedulerOutput(step, requests)).results[-1]
        assert result.logprobs is not None
        ids.append(torch.from_numpy(result.logprobs.token_ids[:, 1:].copy()))
        logprobs.append(torch.from_numpy(result.logprobs.logprobs[:, 1:].copy()))
    return torch.cat(ids), torch.cat(logprobs)
