"""The KV connector's scheduler side: disaggregated prefill, pulled by the decode instance.

After vLLM V1's `KVConnectorBase_V1` in its scheduler role. On a prefill instance (`kv_producer`)
a request sent with `kv_transfer_params: {"do_remote_decode": true}` runs as usual; when it
finishes, `request_finished` keeps its blocks (delay-free), exposes them on the workers' KV
servers and returns the `kv_transfer_params` a decode instance needs. On a decode instance
(`kv_consumer`) a request carrying those params asks `get_num_new_matched_tokens` how many prompt
tokens can be loaded; the scheduler allocates their blocks and parks the request until every rank
has copied its shard (`update_state_after_alloc`, `build_connector_meta`, the workers'
`KVConnectorOutput`), then computes only the prompt's last token. A load that fails or times out
makes the request recompute its prompt (vLLM's "recompute" policy). The prefill frees the blocks
when every decode rank said DONE, on abort, or after `hold_timeout`.

Pure Python: the worker side, with the transports, is `triode.gpu.kv_connector`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from triode.wire.kv_transfer import (
    TRANSPORTS,
    KVConnectorMetadata,
    KVExpose,
    KVLoad,
    KVTransferConfig,
)

from .request import Request, RequestStatus

log = logging.getLogger(__name__)

# the params a decode request must carry, beyond do_remote_prefill
_REMOTE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_block_ids": list,
    "remote_endpoints": list,
    "remote_num_tokens": int,
    "remote_secret": str,
    "tp_size": int,
    "pp_size": int,
    "block_size": int,
    "transport": str,
}
# the finish statuses after which a prefill's KV is whole and worth handing on
_HANDED_ON = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


def transfer_params_error(params: dict[str, Any] | None) -> str | None:
    """What is wrong with a request's `kv_transfer_params`, or None: the shape check the edge
    makes before a request reaches an engine. Whether an engine can use valid params (its
    layout, the prompt) is its own decision; it recomputes where it cannot."""
    if not params:
        return None
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(params.get(flag, False), bool):
            return f"kv_transfer_params.{flag} must be a boolean"
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        return "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other"
    if not params.get("do_remote_prefill"):
        return None
    for name, kind in _REMOTE_FIELDS.items():
        value = params.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"kv_transfer_params.{name} is required with do_remote_prefill"
    if not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0
        for b in params["remote_block_ids"]
    ):
        return "kv_transfer_params.remote_block_ids must be block ids (ints >= 0)"
    if not all(isinstance(e, str) and e.startswith("tcp://") for e in params["remote_endpoints"]):
        return "kv_transfer_params.remote_endpoints must be tcp:// addresses"
    if params["transport"] not in TRANSPORTS:
        return f"kv_transfer_params.transport must be one of {', '.join(TRANSPORTS)}"
    for name in ("remote_num_tokens", "tp_size", "pp_size", "block_size"):
        if params[name] < 1:
            return f"kv_transfer_params.{name} must be >= 1"
    return None


class KVConnectorScheduler:
    """The connector in the scheduler: which requests load, which hold blocks, and what the
    workers hear about it. The scheduler owns the blocks; this decides about them."""

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        block_size: int,
        endpoints: list[str],
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.endpoints = endpoints  # each rank's KV server
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.clock = clock
        self.loading: set[str] = set()
        self.holds: dict[str, float] = {}  # request id -> when its blocks are freed regardless
        self.load_refusals = 0  # params this instance could not use (layout, prompt)
        self._expose: list[KVExpose] = []
        self._release: list[str] = []
        self._loads: list[KVLoad] = []

    @property
    def pending(self) -> bool:
        """Whether any transfer is outstanding: the engine then keeps stepping to hear of it."""
        return bool(self.loading or self.holds or self._release)

    # The decode side

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        """(prompt tokens beyond the `num_computed` found locally that can be loaded, whether
        they load asynchronously): (0, False) for a request that computes its prompt here."""
        params = request.kv_transfer_params
        if (
            not self.config.is_consumer
            or request.kv_load_tried
            or not params
            or not params.get("do_remote_prefill")
        ):
            return 0, False
        request.kv_load_tried = True
        problem = self._incompatible(request, params)
        if problem is not None:
            self.load_refusals += 1
            log.warning("request %s computes its prompt: %s", request.request_id, problem)
            return 0, False
        return max(0, request.num_prompt_tokens - num_computed), True

    def _incompatible(self, request: Request, params: dict[str, Any]) -> str | None:
        if transfer_params_error(params) is not None:
            return transfer_params_error(params)
        layout = (self.tensor_parallel_size, self.pipeline_parallel_size)
        if (params["tp_size"], params["pp_size"]) != layout:
            return (
                f"the prefill instance runs tp {params['tp_size']} x pp {params['pp_size']}, "
                f"this one tp {layout[0]} x pp {layout[1]}"
            )
        if len(params["remote_endpoints"]) != layout[0] * layout[1]:
            return "remote_endpoints does not name one KV server per rank"
        if params["block_size"] != self.block_size:
            return f"block size {params['block_size']} there, {self.block_size} here"
        if params["remote_num_tokens"] != request.num_prompt_tokens:
            return (
                f"the prefill computed {params['remote_num_tokens']} tokens, the prompt here has "
                f"{request.num_prompt_tokens}"
            )
        if len(params["remote_block_ids"]) != -(-request.num_prompt_tokens // self.block_size):
            return "remote_block_ids does not cover the prompt"
        return None

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Plan the load of a request whose blocks were just allocated: the prompt's blocks
        after the local prefix hit, from the same positions of the remote table."""
        params = request.kv_transfer_params
        assert params is not None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        self._loads.append(
            KVLoad(
                request_id=request.request_id,
                block_ids=block_ids[first:num_blocks],
                remote_block_ids=params["remote_block_ids"][first:num_blocks],
                remote_request_id=params["remote_request_id"],
                remote_engine_id=params["remote_engine_id"],
                remote_endpoints=params["remote_endpoints"],
                secret=params["remote_secret"],
                transport=params["transport"],
            )
        )
        self.loading.add(request.request_id)

    def load_done(self, request_id: str) -> None:
        self.loading.discard(request_id)

    # The prefill side

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(whether the scheduler keeps the blocks, the params to return to the client)."""
        params = request.kv_transfer_params
        if (
            not self.config.is_producer
            or not params
            or not params.get("do_remote_decode")
            or request.status not in _HANDED_ON
        ):
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        secret = secrets.token_urlsafe(16)
        remote_block_ids = block_ids[:num_blocks]
        self._expose.append(KVExpose(request.request_id, remote_block_ids, secret))
        self.holds[request.request_id] = self.clock() + self.config.hold_timeout
        host, _, port = self.endpoints[0].removeprefix("tcp://").rpartition(":")
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": remote_block_ids,
            "remote_host": host.strip("[]"),
            "remote_port": int(port),
            "remote_endpoints": self.endpoints,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_secret": secret,
            "tp_size": self.tensor_parallel_size,
            "pp_size": self.pipeline_parallel_size,
            "block_size": self.block_size,
            "transport": self.config.transport,
        }

    def sent(self, request_ids: Iterable[str]) -> list[str]:
        """The holds that every rank's reader said DONE for: theirs to free now."""
        done = [r for r in request_ids if self.holds.pop(r, None) is not None]
        return done

    def drop_hold(self, request_id: str) -> bool:
        """End a hold early (its request was aborted after it finished): True if there was
        one, whose blocks are then the scheduler's to free, no longer served from the next
        step on."""
        if self.holds.pop(request_id, None) is None:
            return False
        self._release.append(request_id)
        return True

    def expired_holds(self) -> list[str]:
        """Holds past their deadline: freed now, and no longer served from the next step on."""
        now = self.clock()
        expired = [r for r, deadline in self.holds.items() if deadline <= now]
        for request_id in expired:
            del self.holds[request_id]
            log.warning("freeing the blocks of %s: no decode instance read them", request_id)
        self._release.extend(expired)
        return expired

    # The workers' word

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """What the workers must do before this step's forward, or None when nothing."""
        sync = bool(self.loading or self.holds)
        if not (self._expose or self._release or self._loads or sync):
            return None
        meta = KVConnectorMetadata(
            expose=self._expose, release=self._release, loads=self._loads, sync=sync
        )
        self._expose, self._release, self._loads = [], [], []
        return meta
