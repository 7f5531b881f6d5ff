"""The request defaults a model's `generation_config.json` recommends, as vLLM takes them.

vLLM's `--generation-config auto` (the default) reads the model's own file, `vllm` reads none
(its neutral defaults stand: temperature 1, top_p 1, top_k and min_p off, no repetition
penalty, as many tokens as the context holds), and a directory reads the file in it;
`--override-generation-config` JSON is laid over whichever was read. Of the file, the sampling
values vLLM takes become the defaults a request falls back on where it leaves a field unset:
temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens.

No torch here: `triode serve` checks the flags in a fraction of a second before any model
process starts (`checks/model.py`), and the engine core reads the same defaults once the model
is resolved.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FILE = "generation_config.json"
# The default model (SmolLM2-135M-Instruct, as a GGUF with no generation config) as its model
# card recommends sampling it: at vLLM's neutral temperature 1 it answers with word salad.
DEFAULT_MODEL_CARD: dict[str, Any] = {"temperature": 0.2, "top_p": 0.9}
# a generation config is a few hundred bytes; anything near this is no model's
MAX_FILE_BYTES = 1 << 20
# top_k and max_new_tokens stay below this: token ids and counts do, on the wire and in every
# vocabulary and context (a larger integer would not even cross to the edges)
MAX_INTEGER = 2**31 - 1
# the largest temperature and repetition penalty, and the reciprocal of the smallest penalty:
# the sampler holds them as float32 and scales by them what is under 2**27 in size (logits, an
# Exp(1) draw's log), which stays finite then. Past float32's range a temperature is infinite,
# and the -inf that disallows a token (allowed_token_ids, a grammar's mask) turns NaN in its
# product, which the sampler's argmax takes. The same bound as a request's
# (`triode.wire.messages.MAX_SAMPLING_SCALE`), kept here: importing the wire package would
# cost the model check before `triode serve` starts a third of a second.
MAX_SCALE = 2.0**100
# the longest value or key an error line quotes
_QUOTED = 40
# generation_config.json's keys that vLLM takes -> the request field each is the default of
REQUEST_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class GenerationConfigError(ValueError):
    """A `--generation-config` or `--override-generation-config` that cannot give defaults: a
    directory without the file, a file or override that is not a JSON object, an unknown
    override key, or a value out of its range."""


def request_defaults(
    model_dir: str | Path | None,
    generation_config: str = "auto",
    override: Mapping[str, Any] | str | None = None,
    *,
    card: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The request defaults (`REQUEST_FIELDS`' request names -> value) for the model in
    `model_dir`: its generation config as `generation_config` chooses it ("auto": the model's
    file, if it has one, else `card`, what its model card recommends; "vllm": none; else a
    directory holding the file), `override` laid over it. Raises `GenerationConfigError`."""
    config: dict[str, Any] = {}
    if generation_config == "auto":
        if model_dir is not None and (Path(model_dir) / FILE).is_file():
            config = _read(Path(model_dir) / FILE)
        elif card is not None:
            config = dict(card)
    elif generation_config != "vllm":
        path = Path(generation_config).expanduser() / FILE
        if not path.is_file():
            raise GenerationConfigError(
                f"--generation-config {generation_config}: no {FILE} there (give auto, vllm, "
                f"or a directory holding {FILE})"
            )
        config = _read(path)
    config.update(parse_override(override))
    return {
        field: _checked(key, config[key])
        for key, field in REQUEST_FIELDS.items()
        if config.get(key) is not None
    }


def parse_override(override: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """`--override-generation-config` as a dict: JSON text or a mapping whose keys are all
    `REQUEST_FIELDS`' generation config names. Raises `GenerationConfigError`."""
    if override is None:
        return {}
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except (ValueError, RecursionError) as e:  # nesting past the parser's depth
            raise GenerationConfigError(
                f"--override-generation-config is not valid JSON: {e}"
            ) from None
    if not isinstance(override, Mapping):
        raise GenerationConfigError(
            "--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.7}'"
        )
    unknown = sorted(_quoted(str(k)) for k in override if k not in REQUEST_FIELDS)
    if unknown:
        raise GenerationConfigError(
            f"--override-generation-config: unknown key {', '.join(unknown)}; "
            f"known: {', '.join(REQUEST_FIELDS)}"
        )
    return {key: _checked(key, value) for key, value in override.items()}


def _read(path: Path) -> dict[str, Any]:
    try:
        too_large = path.stat().st_size > MAX_FILE_BYTES
        config = None if too_large else json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # nesting past the parser's depth
        raise GenerationConfigError(f"{path}: cannot be read as JSON: {e}") from None
    if too_large:
        raise GenerationConfigError(f"{path}: over {MAX_FILE_BYTES} bytes, not a generation config")
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path}: not a JSON object")
    return config


def _checked(key: str, value: Any) -> Any:
    """`value` if it is one a request may give for `key`'s field and the sampler holds as it is
    (`MAX_INTEGER`, `MAX_SCALE`), else the error naming it."""
    if value is None:
        return None
    number = math.nan  # what no bound takes: a value that is no number, or none a float holds
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer past any float
            pass
    integral = number.is_integer() and abs(number) <= MAX_INTEGER
    ok = {
        "temperature": 0 <= number <= MAX_SCALE,
        "top_p": 0 < number <= 1,
        "top_k": integral and number >= -1,
        "min_p": 0 <= number <= 1,
        "repetition_penalty": 1 / MAX_SCALE <= number <= MAX_SCALE,
        "max_new_tokens": integral and number >= 1,
    }[key]
    if not ok:
        raise GenerationConfigError(f"generation config: {key} {_shown(value)} is out of range")
    return int(number) if key in ("top_k", "max_new_tokens") else number


def _shown(value: Any) -> str:
    """`value` as an error line quotes it: its repr, cut short."""
    try:
        return _quoted(value)
    except ValueError:  # holding an integer of more digits than Python prints
        return f"<{type(value).__name__} too long to print>"


def _quoted(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTED else f"{text[: _QUOTED - 3]}..."
