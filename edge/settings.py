"""What the HTTP app is started with (`Settings`): the names it answers to, its keys, limits,
CORS origins, tool servers and whether it serves the administrative routes. Its own module so
that the app and the endpoint families it routes to (completions, responses) read it without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from .auth import ApiKeys
from .tenancy import Isolation


@dataclass
class Settings:
    """How the app serves: the names it answers to, its keys, limits and CORS origins."""

    served_model_names: list[str]
    api_keys: ApiKeys = field(default_factory=lambda: ApiKeys(()))
    max_body_size: int = 16 << 20
    allowed_origins: list[str] = field(default_factory=list)
    keepalive_interval: float = 15.0
    # the Responses API: MCP tool servers, and how long and how often the model may use them
    tool_servers: list[str] = field(default_factory=list)
    allow_request_tool_servers: bool = False
    tool_call_timeout: float = 30.0
    max_tool_turns: int = 8
    max_stored_responses: int = 1000
    # the stored finished responses' bytes as JSON, all together (`responses.store`)
    max_stored_response_bytes: int = 256 << 20
    # "key": requests share cached prefix blocks only with requests under the same API key
    prefix_cache_isolation: Isolation = "none"
    # caps on what one request may cost (edge/completions/): its choices (prompts x n), the
    # logprob entries of a whole answer, and its prompt_embeds' bytes (once per choice)
    max_choices_per_request: int = 2048
    max_logprob_entries: int = 1 << 20
    max_prompt_embeds_bytes: int = 256 << 20
    # /health is 503 once the engine core has made no step for this long with work pending
    health_stall_timeout: float = 60.0
    # /metrics behind the key too (it is open for scrapers by default)
    metrics_require_key: bool = False
    # background responses running or queued at once (429 past it); seconds a stored one lives
    max_background_responses: int = 32
    response_ttl: float = 3600.0
    # request-named MCP servers may be on loopback, private or link-local addresses
    allow_private_tool_servers: bool = False
    # the administrative routes (edge/admin.py: sleep, pause, profiling, new weights); 404s
    # without it
    enable_admin_api: bool = False
