"""A first run as a new user makes it: `triode serve` with no arguments serves the default model
sampled as its model card recommends, so the first answer to a plain question is right."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server import running_server

pytestmark = pytest.mark.slow


def test_the_default_model_answers_a_first_question_at_its_cards_defaults(
    model_dir: Path, tmp_path: Path
) -> None:
    question = {"messages": [{"role": "user", "content": "Hi! What is the capital of France?"}]}
    with running_server([], tmp_path / "serve.log", {"TRIODE_LOG_LEVEL": "INFO"}) as server:
        answers = [
            httpx.post(f"{server.url}/v1/chat/completions", json=question, timeout=60)
            for _ in range(4)
        ]
        log = server.output()
    texts = [a.json()["choices"][0]["message"]["content"] for a in answers]
    assert all("Paris" in t for t in texts), texts
    assert sum("The capital of France is Paris." in t for t in texts) >= 3, texts
    assert "request defaults (where a request leaves them unset): temperature 0.2, top_p 0.9" in log
    assert "the default model's card" in log
