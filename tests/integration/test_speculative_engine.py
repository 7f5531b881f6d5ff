"""Suffix decoding through the embedding API on the real default model: a second request that
copies what an earlier one answered is proposed that answer from the global cache of outputs,
and every greedy answer is transformers' token for token; the engine's stats count it all."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from engine_calls import final_output
from reference import Reference

from triode.actors import SamplingParams, open_engine

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


async def test_suffix_decoding_proposes_from_earlier_answers_and_stays_exact(
    model_dir: Path, reference: Reference
) -> None:
    first = reference.encode("The three primary colors of light are")
    # asked again: the answer comes back from the cache of earlier outputs
    again = reference.encode("The three primary colors of light are")
    # float32, as transformers' reference runs: bfloat16 answers part from it at near-ties
    async with open_engine(str(model_dir), dtype="float32", speculative_config=SUFFIX) as engine:
        outputs = [await final_output(engine, first, GREEDY)]
        before = await engine.get_stats()
        outputs.append(await final_output(engine, again, GREEDY))
        after = await engine.get_stats()
        with trio.fail_after(10):
            while (await engine.get_stats())["kv_cache_usage"]:  # noqa: ASYNC110 - a poll
                await trio.sleep(0.05)
    for prompt, out in zip((first, again), outputs, strict=True):
        assert out.outputs[0].token_ids == reference.greedy(tuple(prompt), NEW_TOKENS)
    assert after["spec_num_draft_tokens"] > before["spec_num_draft_tokens"]
    assert after["spec_num_accepted_tokens"] > before["spec_num_accepted_tokens"]
    per_pos = after["spec_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 8 and sum(per_pos) == after["spec_num_accepted_tokens"]
