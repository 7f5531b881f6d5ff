"""A request's structured-output constraint as an llguidance grammar: the grammar it stands
for (`grammar_of`), and whether that compiles (`check_grammar`), checked without an engine.

The edge checks a request with them before it leaves (a schema that cannot work is the
client's error), and the engine core's structured output manager
(`core/structured_output.py`) builds its matchers from the same grammar.

llguidance is imported where a grammar is made, not with this module: `triode.actors` exports
these checks, and each of its importers would otherwise pay for loading llguidance, which only
a server that takes constrained requests needs.
"""

from __future__ import annotations

import json

from triode.wire.messages import StructuredOutputsParams

# JSON is generated compactly ("a": 1, "b": 2) rather than with free whitespace: a model that
# may emit any whitespace can stall in it, and every byte of it costs a token.
_JSON_OPTIONS = {"whitespace_flexible": False}

_JSON_OBJECT = '{"type": "object"}'


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for `params`. Raises ValueError("field: why")
    for a constraint that cannot be parsed; whether it compiles is `check_grammar`'s job."""
    import llguidance  # not at import time: see the module's docstring

    try:
        if params.json is not None or params.json_object:
            schema = params.json if params.json is not None else _JSON_OBJECT
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        assert params.grammar is not None
        lark = params.grammar
        if "::=" in lark:  # GBNF, as llama.cpp and xgrammar take it
            lark = llguidance.gbnf_to_lark.gbnf_to_lark(lark)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError, llguidance.gbnf_to_lark.GbnfToLarkError) as e:
        raise ValueError(f"{constraint_field(params)}: {e}") from e


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ValueError("field: why") unless `params` compiles. CPU work proportional to the
    schema: callers on an event loop run it in a thread."""
    import llguidance  # not at import time: see the module's docstring

    grammar = grammar_of(params)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if failed:
        raise ValueError(f"{constraint_field(params)}: {messages[0] if messages else 'invalid'}")


def constraint_field(params: StructuredOutputsParams) -> str:
    """The name of the field of `params` that holds its constraint (error messages name it)."""
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(params, name) is not None:
            return name
    return "json_object"
