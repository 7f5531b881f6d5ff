"""The grammar engines `triode bench structured` sets side by side, behind one shape: llguidance
(what triode serves with) and xgrammar (optional: measured when it is installed). Each compiles a
JSON schema, copies matchers from a compiled grammar, fills a batch's token bitmask and accepts a
token; `ModelFiles` is what they need of a model."""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path
from typing import Any, NamedTuple

import llguidance
import llguidance.numpy
import numpy as np

from triode.actors import Engine, grammar_of
from triode.wire import StructuredOutputsParams

# The JSON that triode's grammars accept: compact separators (see `structured_output`).
SEPARATORS = (",", ":")


class ModelFiles(NamedTuple):
    """What a grammar engine needs of a model: its tokenizer and its logits' width."""

    dir: Path
    vocab_size: int
    eos_ids: list[int]

    @property
    def tokenizer_file(self) -> Path:
        return self.dir / "tokenizer.json"

    @classmethod
    def of_engine(cls, engine: Engine) -> ModelFiles:
        eos = [engine.eos_token_id, *engine.extra_eos_token_ids]
        return cls(engine.model_dir, engine.vocab_size, [t for t in eos if t is not None])

    @classmethod
    def of_dir(cls, model_dir: Path) -> ModelFiles:
        config = json.loads((model_dir / "config.json").read_text())
        eos = config.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(model_dir, config["vocab_size"], eos_ids)


class _Llguidance:
    def __init__(self, model: ModelFiles, threads: int | None) -> None:
        self.name = f"llguidance {importlib.metadata.version('llguidance')}"
        self.words = (model.vocab_size + 31) // 32
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(
            model.tokenizer_file.read_text(), n_vocab=model.vocab_size, eos_token=model.eos_ids
        )
        self.setup_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor(threads)

    def compile(self, schema: str) -> llguidance.LLMatcher:
        grammar = grammar_of(StructuredOutputsParams(json=schema))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{self.name}: {matcher.get_error()}")
        return matcher

    def matchers(self, compiled: llguidance.LLMatcher, n: int) -> list[llguidance.LLMatcher]:
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers: list[llguidance.LLMatcher], mask: np.ndarray) -> None:
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, pairs, mask)

    def accept(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        return matcher.consume_token(token)


class _Xgrammar:
    def __init__(self, model: ModelFiles, threads: int | None) -> None:
        # optional, and slow to import: only once this engine is measured (an ImportError
        # marks it not installed)
        import xgrammar
        from transformers import AutoTokenizer

        self.xgr = xgrammar
        self.name = f"xgrammar {importlib.metadata.version('xgrammar')}"
        self.words = (model.vocab_size + 31) // 32
        start = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(model.dir)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=model.vocab_size, stop_token_ids=model.eos_ids
        )
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.batch = xgrammar.BatchGrammarMatcher(threads or "auto")

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(
            schema, any_whitespace=False, separators=SEPARATORS
        )

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list[Any], mask: np.ndarray) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


GrammarEngine = _Llguidance | _Xgrammar
ENGINES: dict[str, type[GrammarEngine]] = {"llguidance": _Llguidance, "xgrammar": _Xgrammar}
