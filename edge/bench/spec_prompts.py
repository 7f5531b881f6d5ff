"""The two workloads of `triode bench spec`, built offline and the same for the same seed.

grounded: tasks whose answer copies much of the prompt (repeat a passage word for word, correct
its typos, summarise it, rewrite it in the passive voice or as bullet points, add type hints to a
function, rename one of its variables), over real text that every Python installation holds: the
paragraphs of the standard library's docstrings, the Zen of Python, and the source of standard
library functions. Prompt lookup and suffix decoding find their proposals in such prompts.

chat: ordinary questions with nothing in the prompt to copy, where proposals find little.
"""

from __future__ import annotations

import codecs
import importlib
import importlib.util
import inspect
import random
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Generic, TypeVar

T = TypeVar("T")

# a prose passage's words and a code passage's lines, at least and at most
PROSE_WORDS = (40, 150)
CODE_LINES = (10, 40)

PROSE_MODULES = (
    "argparse", "asyncio.locks", "bisect", "calendar", "collections", "contextlib", "csv",
    "dataclasses", "decimal", "difflib", "enum", "fractions", "functools", "heapq", "inspect",
    "ipaddress", "json", "logging", "pathlib", "pickle", "queue", "random", "sched", "shlex",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "timeit",
    "unittest.case", "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip
CODE_MODULES = (
    "argparse", "calendar", "csv", "difflib", "fractions", "ftplib", "functools", "glob",
    "gettext", "heapq", "ipaddress", "json.encoder", "mimetypes", "netrc", "ntpath", "os",
    "platform", "posixpath", "quopri", "shlex", "shutil", "statistics", "string", "tarfile",
    "textwrap", "tokenize", "urllib.parse", "uuid", "wave", "zipfile",
)  # fmt: skip

PROSE_TASKS = {
    "repeat": "Repeat the following passage word for word, changing nothing.",
    "typos": "Correct the typos in the following passage and return the corrected passage.",
    "summarise": "Summarise the following passage in a few sentences.",
    "passive": "Rewrite the following passage in the passive voice.",
    "bullets": "Rewrite the following passage as a list of bullet points.",
}
CODE_TASKS = {
    "type hints": "Add type hints to this Python code and return the whole function.",
    "rename": "In this Python code, rename the variable `{old}` to `{new}` and return the whole "
    "function.",
}
TASKS = (*PROSE_TASKS, *CODE_TASKS)

CHAT_QUESTIONS = (
    "Explain why the sky is blue.",
    "Write a haiku about autumn.",
    "Give three tips for learning a language.",
    "What is the difference between weather and climate?",
    "How do vaccines train the immune system?",
    "Suggest a name for a bakery that sells only bread.",
    "Why do cats purr?",
    "Describe how a rainbow forms.",
    "What should I pack for a weekend hiking trip?",
    "Write a short poem about the sea.",
    "How does a bicycle stay upright?",
    "Give me an idea for a birthday party for a seven-year-old.",
    "What are the benefits of regular exercise?",
    "Explain what a black hole is to a child.",
    "How do I make a cup of tea?",
    "Why do leaves change colour in the autumn?",
    "Tell me a fun fact about octopuses.",
    "What is photosynthesis?",
    "Write a limerick about a forgetful wizard.",
    "How can I sleep better at night?",
    "What causes the seasons on Earth?",
    "Recommend three classic novels and say why.",
    "How do bees make honey?",
    "Explain the rules of chess in brief.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me a simple recipe for pancakes.",
    "Why is the ocean salty?",
    "How do airplanes fly?",
    "Write a two-sentence scary story.",
    "What are some ways to reduce stress?",
    "Explain how the internet works in simple terms.",
    "What is the tallest mountain in the world and how tall is it?",
    "Describe a sunset to someone who has never seen one.",
    "How do I start learning to play the guitar?",
    "Why do we dream?",
    "What is the water cycle?",
    "Write a thank-you note to a teacher.",
    "How do magnets work?",
    "What are good habits for saving money?",
    "Invent a new holiday and describe how people celebrate it.",
    "Why do stars twinkle?",
    "Compare dogs and cats as pets.",
    "What makes a good friend?",
    "How do volcanoes erupt?",
    "Write a short motivational message for a Monday morning.",
    "What is the difference between a virus and a bacterium?",
    "Describe the taste of chocolate without using the word sweet.",
    "How does recycling help the environment?",
)
# appended, in turn, once every question has been asked once, twice, ...
CHAT_STYLES = ("", " Keep it short.", " Answer as if to a ten-year-old.", " Answer formally.")


@dataclass(frozen=True)
class Prompt:
    """One user message: its workload, task, text, and the passage it holds (grounded only)."""

    workload: str
    task: str
    text: str
    passage: str = ""


def prose_passages() -> list[str]:
    """Prose paragraphs of `PROSE_WORDS` words from the docstrings of `PROSE_MODULES` (each
    module's, its functions' and its classes'), and the Zen of Python; in a fixed order."""
    found: list[str] = []
    for module in _modules(PROSE_MODULES):
        docs = [module.__doc__] + [obj.__doc__ for obj in _own_objects(module, classes=True)]
        for doc in docs:
            text = doc if isinstance(doc, str) else ""
            for paragraph in inspect.cleandoc(text).split("\n\n"):
                if _is_prose(paragraph):
                    found.append(" ".join(paragraph.split()))
    found.append(zen_of_python())
    return list(dict.fromkeys(p for p in found if _fits_prose(p)))


def zen_of_python() -> str:
    """The Zen of Python, read from the `this` module's source (importing it prints it)."""
    spec = importlib.util.find_spec("this")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    match = re.search(r's = """(.*?)"""', source, re.DOTALL)
    assert match is not None
    return codecs.decode(match.group(1), "rot13").strip()


def code_passages() -> list[tuple[str, str]]:
    """(source, a variable it uses) of the functions of `CODE_MODULES` of `CODE_LINES` lines
    with a parameter that the body uses; in a fixed order."""
    found = []
    for module in _modules(CODE_MODULES):
        for function in _own_objects(module, classes=False):
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            lines = source.rstrip().splitlines()
            if not CODE_LINES[0] <= len(lines) <= CODE_LINES[1]:
                continue
            variable = _used_parameter(function, source)
            if variable is not None:
                found.append((source.rstrip(), variable))
    return found


def grounded_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """`n` grounded prompts, the tasks in turn, each over a passage drawn with `seed` (every
    passage of a kind once before any twice)."""
    rng = random.Random(seed)
    prose = _Draw(prose_passages(), rng)
    code = _Draw(code_passages(), rng)
    prompts = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        if task in PROSE_TASKS:
            passage = prose.next()
            if task == "typos":
                passage = with_typos(passage, rng)
            text = f"{PROSE_TASKS[task]}\n\n{passage}"
        else:
            passage, variable = code.next()
            instruction = CODE_TASKS[task].format(old=variable, new=f"{variable}_value")
            text = f"{instruction}\n\n```python\n{passage}\n```"
        prompts.append(Prompt("grounded", task, text, passage))
    return prompts


def chat_prompts(n: int) -> list[Prompt]:
    """`n` chat prompts: `CHAT_QUESTIONS` in order, then again with each of `CHAT_STYLES`."""
    count = len(CHAT_QUESTIONS)
    return [
        Prompt("chat", "chat", CHAT_QUESTIONS[i % count] + CHAT_STYLES[i // count % 4])
        for i in range(n)
    ]


def workload_prompts(workload: str, n: int, seed: int = 0) -> list[Prompt]:
    """`n` prompts of `workload` ("grounded" or "chat"); ValueError for another name."""
    if workload == "grounded":
        return grounded_prompts(n, seed)
    if workload == "chat":
        return chat_prompts(n)
    raise ValueError(f"no workload {workload!r}: grounded or chat")


def with_typos(text: str, rng: random.Random, every: int = 6) -> str:
    """`text` with about one word in `every` of five or more letters given a typo: two of its
    inner letters swapped."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) >= 5 and word.isalpha() and rng.randrange(every) == 0:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


class _Draw(Generic[T]):
    """Items in a shuffled order, reshuffled each time all were drawn."""

    def __init__(self, items: list[T], rng: random.Random) -> None:
        if not items:
            raise RuntimeError("no passages found in the standard library")
        self.items, self.rng = items, rng
        self.order: list[int] = []

    def next(self) -> T:
        if not self.order:
            self.order = list(range(len(self.items)))
            self.rng.shuffle(self.order)
        return self.items[self.order.pop()]


def _modules(names: tuple[str, ...]) -> list[ModuleType]:
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            continue  # a Python built without it
    return modules


def _own_objects(module: ModuleType, *, classes: bool) -> list:
    """The functions (and classes) `module` defines itself, by name."""
    return [
        obj
        for _, obj in sorted(vars(module).items())
        if (inspect.isfunction(obj) or (classes and inspect.isclass(obj)))
        and getattr(obj, "__module__", None) == module.__name__
    ]


def _is_prose(paragraph: str) -> bool:
    """Sentences, not an example, a list, a table or a section of parameters."""
    lines = paragraph.splitlines()
    if not lines or any(line[:1].isspace() for line in lines):
        return False
    if any(mark in paragraph for mark in (">>>", "::", "|", "-->", "==", "{", "}")):
        return False
    if any(line.rstrip().endswith(":") for line in lines) or lines[0][:1] in "-*+":
        return False
    words = paragraph.split()
    return sum(w.strip(".,;:()'\"`").isalpha() for w in words) >= 0.8 * len(words)


def _fits_prose(passage: str) -> bool:
    return PROSE_WORDS[0] <= len(passage.split()) <= PROSE_WORDS[1]


def _used_parameter(function: object, source: str) -> str | None:
    """The first parameter, other than self and cls, that the body names at least twice."""
    try:
        names = list(inspect.signature(function).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    for name in names:
        if name not in ("self", "cls") and len(re.findall(rf"\b{name}\b", source)) >= 3:
            return name
    return None
