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

The params are a cluster protocol, not a client feature (`triode.wire.kv_seal`): the prefill
seals what it returns, over a digest of the prompt; the decode loads only for sealed params made
for the very prompt it was given, so another prompt's KV never enters its prefix cache under
this one's hashes. A prefill holds blocks only for a `do_remote_decode` request that the
deployment's proxy sealed, only the prompt's blocks, and only up to `max_hold_fraction` of its
cache; past that the request finishes without a hold, and its params say so (`"hold": false`),
so the decode computes the prompt itself.

Pure Python: the worker side, with the transports, is `triode.gpu.kv.connector`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from triode.wire import kv_seal
from triode.wire.kv_transfer import (
    KVConnectorMetadata,
    KVExpose,
    KVLoad,
    KVTransferConfig,
)

from ..kv_params import seal_error, transfer_params_error
from .request import Request, RequestStatus

log = logging.getLogger(__name__)

# what a prefill returns when it keeps no blocks: the decode computes the prompt itself
_NO_HOLD: dict[str, Any] = {"do_remote_prefill": False, "do_remote_decode": False, "hold": False}
# the finish statuses after which a prefill's KV is whole and worth handing on
_HANDED_ON = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


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
        secret: bytes | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`secret` is the deployment's (default: read from the config's `secret_file`, which
        raises `kv_seal.SecretFileError` when it cannot serve). `wall_clock` dates seals,
        which other hosts check; `clock` times holds."""
        self.config = config
        self.secret = config.read_secret() if secret is None else secret
        self.wall_clock = wall_clock
        self.block_size = block_size
        self.endpoints = endpoints  # each rank's KV server
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.clock = clock
        self.loading: set[str] = set()
        self.holds: dict[str, float] = {}  # request id -> when its blocks are freed regardless
        self.held_blocks: dict[str, int] = {}  # request id -> how many blocks it holds
        self.num_held_blocks = 0
        # the cache's size, which holds may take `max_hold_fraction` of: the scheduler's
        self.num_blocks = 0
        # requests whose `do_remote_decode` the proxy sealed, checked on arrival
        self._may_hold: set[str] = set()
        self._nonces: dict[str, float] = {}  # used do_remote_decode nonces -> their expiry
        self.load_refusals = 0  # params this instance could not use (layout, prompt)
        self.seal_refusals = 0  # params refused unsealed, altered, expired or for another prompt
        self._expose: list[KVExpose] = []
        self._release: list[str] = []
        self._loads: list[KVLoad] = []
        self._cancel: list[str] = []
        # requests admitted to load that have not started: with `loading`, capped
        self._admitted: set[str] = set()
        self.loads_refused = 0  # past max_concurrent_loads

    @property
    def pending(self) -> bool:
        """Whether any transfer is outstanding: the engine then keeps stepping to hear of it."""
        return bool(self.loading or self.holds or self._release or self._cancel)

    def request_added(self, request: Request) -> None:
        """Note a new request: a `do_remote_decode` one may hold blocks when it finishes only
        if the deployment's proxy sealed it, which is checked now, while the seal is fresh."""
        params = request.kv_transfer_params
        if not (self.config.is_producer and params and params.get("do_remote_decode") is True):
            return
        now = self.wall_clock()
        # seals are issued in about the order they arrive, so the oldest nonces come first;
        # one past its expiry is refused by its seal anyway
        while self._nonces and next(iter(self._nonces.values())) < now:
            del self._nonces[next(iter(self._nonces))]
        problem = seal_error(self.secret, params, [], now=now)
        if problem is None:
            problem = self._replayed(params, now)
        if problem is not None:
            self.seal_refusals += 1
            log.warning("request %s holds no blocks: %s", request.request_id, problem)
            return
        self._may_hold.add(request.request_id)

    def _replayed(self, params: dict[str, Any], now: float) -> str | None:
        """Why a proxy's sealed `do_remote_decode` may not hold blocks again (its nonce was
        used before it expired), or None, remembering the nonce until its expiry. Only seals
        this deployment made get here, so the memory is bounded by the proxies' request rate
        over `kv_seal.REMOTE_DECODE_TTL`."""
        nonce = params.get(kv_seal.NONCE)
        if not isinstance(nonce, str):
            return "kv_transfer_params: a sealed do_remote_decode carries no nonce"
        if nonce in self._nonces:
            return "kv_transfer_params: this do_remote_decode was already used"
        self._nonces[nonce] = float(params[kv_seal.EXPIRES_AT])
        return None

    # The decode side

    def admit_load(self, request_id: str, params: dict[str, Any] | None) -> str | None:
        """Count a new request that asks to load its prompt; why it must be refused for now
        (it would pass `max_concurrent_loads`), or None. Every admitted load leaves the count
        when it is tried, through, or cancelled (`cancel_load`)."""
        if not (self.config.is_consumer and params and params.get("do_remote_prefill") is True):
            return None
        cap = self.config.max_concurrent_loads
        if len(self.loading) + len(self._admitted) >= cap:
            self.loads_refused += 1
            return (
                f"the server is busy: {cap} KV loads are under way "
                "(kv_connector_extra_config.max_concurrent_loads); try again later"
            )
        self._admitted.add(request_id)
        return None

    def cancel_load(self, request_id: str) -> None:
        """An aborted request's load: one not started leaves the count; one under way is
        stopped on every rank, which report it failed, and stays `loading` (its blocks the
        scheduler's to keep) until every rank is through with it."""
        self._admitted.discard(request_id)
        if request_id in self.loading:
            self._cancel.append(request_id)

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
        self._admitted.discard(request.request_id)
        problem = self._incompatible(request, params)
        if problem is not None:
            self.load_refusals += 1
            log.warning("request %s computes its prompt: %s", request.request_id, problem)
            return 0, False
        return max(0, request.num_prompt_tokens - num_computed), True

    def _incompatible(self, request: Request, params: dict[str, Any]) -> str | None:
        # The seal first: nothing else in params is believed before it, and nobody is
        # connected to for params that are not this deployment's, for this very prompt.
        problem = seal_error(
            self.secret,
            params,
            request.prompt_token_ids,
            request.cache_salt,
            now=self.wall_clock(),
        )
        if problem is not None:
            self.seal_refusals += 1
            return problem
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

    def load_done(self, request_id: str) -> bool:
        """Forget a finished load; whether it was one this connector planned, for params it
        verified (only such a load's blocks may enter the prefix cache)."""
        planned = request_id in self.loading
        self.loading.discard(request_id)
        return planned

    # The prefill side

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(whether the scheduler keeps the request's first `prompt_blocks(request)` blocks,
        the params to return to the client).

        Held only for a request the proxy sealed (`request_added`) that finished whole, and
        only while holds take at most `max_hold_fraction` of the cache; otherwise params that
        say `"hold": false` come back, with which a decode computes the prompt itself."""
        params = request.kv_transfer_params
        may_hold = request.request_id in self._may_hold
        self._may_hold.discard(request.request_id)
        if (
            not self.config.is_producer
            or not params
            or not params.get("do_remote_decode")
            or request.status not in _HANDED_ON
        ):
            return False, None
        num_blocks = self.prompt_blocks(request)
        if not may_hold:
            return False, dict(_NO_HOLD)
        room = int(self.config.max_hold_fraction * self.num_blocks) - self.num_held_blocks
        if num_blocks > room:
            log.warning(
                "request %s finishes without a hold: %d blocks are held for decodes already",
                request.request_id,
                self.num_held_blocks,
            )
            return False, dict(_NO_HOLD)
        secret = secrets.token_urlsafe(16)
        remote_block_ids = block_ids[:num_blocks]
        self._expose.append(KVExpose(request.request_id, remote_block_ids, secret))
        self.holds[request.request_id] = self.clock() + self.config.hold_timeout
        self.held_blocks[request.request_id] = num_blocks
        self.num_held_blocks += num_blocks
        host, _, port = self.endpoints[0].removeprefix("tcp://").rpartition(":")
        handed_on = {
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
        digest = kv_seal.prompt_digest(request.prompt_token_ids, request.cache_salt)
        sealed = kv_seal.seal(
            self.secret, handed_on, digest, ttl=self.config.hold_timeout, now=self.wall_clock()
        )
        return True, sealed

    def prompt_blocks(self, request: Request) -> int:
        """How many blocks a request's prompt fills: what a hold keeps."""
        return -(-request.num_prompt_tokens // self.block_size)

    def _unhold(self, request_id: str) -> bool:
        if self.holds.pop(request_id, None) is None:
            return False
        self.num_held_blocks -= self.held_blocks.pop(request_id, 0)
        return True

    def sent(self, request_ids: Iterable[str]) -> list[str]:
        """The holds that every rank's reader said DONE for: theirs to free now."""
        return [r for r in request_ids if self._unhold(r)]

    def drop_hold(self, request_id: str) -> bool:
        """End a hold early (its request was aborted after it finished): True if there was
        one, whose blocks are then the scheduler's to free, no longer served from the next
        step on."""
        if not self._unhold(request_id):
            return False
        self._release.append(request_id)
        return True

    def expired_holds(self) -> list[str]:
        """Holds past their deadline: freed now, and no longer served from the next step on."""
        now = self.clock()
        expired = [r for r, deadline in self.holds.items() if deadline <= now]
        for request_id in expired:
            self._unhold(request_id)
            log.warning("freeing the blocks of %s: no decode instance read them", request_id)
        self._release.extend(expired)
        return expired

    # The workers' word

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """What the workers must do before this step's forward, or None when nothing."""
        sync = bool(self.loading or self.holds)
        if not (self._expose or self._release or self._loads or self._cancel or sync):
            return None
        meta = KVConnectorMetadata(
            expose=self._expose,
            release=self._release,
            loads=self._loads,
            sync=sync,
            cancel=self._cancel,
        )
        self._expose, self._release, self._loads, self._cancel = [], [], [], []
        return meta
