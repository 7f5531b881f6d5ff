"""`--lora-modules` entries (`LoRAModule`): how one is spelled (`parse_lora_module`) and what a
served adapter's name may be (`lora_name_problem`)."""

from __future__ import annotations

import msgspec

from triode.wire.messages import MAX_LORA_NAME


class LoRAModule(msgspec.Struct, forbid_unknown_fields=True):
    """One `--lora-modules` entry: the adapter's name, its PEFT directory, and the model it was
    trained on (None: the served one)."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_name_problem(name: object) -> str | None:
    """Why `name` cannot name a LoRA adapter, or None: it must be 1 to `MAX_LORA_NAME`
    printable characters with no whitespace (it is an OpenAI model name)."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME:
        return f"an adapter's name must be 1 to {MAX_LORA_NAME} characters"
    if not name.isprintable() or any(c.isspace() for c in name):
        return f"the adapter name {name!r} must be printable, with no whitespace"
    return None


_MODULE_FORMS = 'give name=path, or JSON \'{"name": "n", "path": "p", "base_model_name": "m"}\''


def parse_lora_module(text: str) -> LoRAModule:
    """A `--lora-modules` entry: `name=path`, or vLLM's JSON object. ValueError naming the
    entry for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"lora_modules: {text!r} is not text; {_MODULE_FORMS}")
    if text.lstrip().startswith("{"):
        try:
            module = msgspec.json.decode(text, type=LoRAModule)
        except msgspec.ValidationError as e:
            raise ValueError(f"lora_modules: {text!r}: {e}; {_MODULE_FORMS}") from None
        except msgspec.DecodeError:
            raise ValueError(f"lora_modules: {text!r} is not valid JSON; {_MODULE_FORMS}") from None
    else:
        name, equals, path = text.partition("=")
        if not equals:
            raise ValueError(f"lora_modules: {text!r} has no '='; {_MODULE_FORMS}")
        module = LoRAModule(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ValueError(f"lora_modules: {text!r} needs a name and a path; {_MODULE_FORMS}")
    return module
