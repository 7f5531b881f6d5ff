"""Engine arguments: one validated struct that crosses to the engine, and, on its fields, how
`triode serve` spells each as a flag (`EngineFlag`): the struct is the flags' one source."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from triode.wire.cluster_key import MAKE_ONE
from triode.wire.kv_transfer import parse_kv_transfer_config

from .core.kv_events import parse_kv_events_config
from .core.speculation.config import parse_speculative_config
from .lora_modules import LoRAModule, lora_name_problem, parse_lora_module
from .sizes import parse_size

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "dense-head", "none")
GGUF_ARITHMETICS = ("exact", "integer")
RUNNERS = ("auto", "generate", "pooling")
# vLLM's allowed --max-lora-rank values
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
EXECUTOR_BACKENDS = ("mp", "inproc")


@dataclass(frozen=True)
class EngineFlag:
    """How an `EngineArgs` field is spelled on `triode serve`'s command line: `max_num_seqs` is
    `--max-num-seqs`, of the field's type; the struct's default stands when it is not given. A
    field without one is a flag of the engine group, with no help text."""

    help: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    short: str | None = None  # a second spelling, as `-tp`
    # where `triode serve --help` lists it: "engine", "parallelism", "options" (the command's
    # own), or None: not a flag
    group: str | None = "engine"


# the model is the command's positional argument; the block size is the engine's own choice
NOT_A_FLAG = EngineFlag(group=None)


class EngineArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What an engine is started with; names follow the `triode serve` flags."""

    # a Hugging Face directory, a .gguf file, or None: the default model
    model: Annotated[str | None, NOT_A_FLAG] = None
    # auto | float32 | bfloat16 | float16
    dtype: Annotated[str, EngineFlag(choices=DTYPES)] = "auto"
    # auto: a GGUF checkpoint's own blocks where supported | dense-head | none
    quantization: Annotated[
        str,
        EngineFlag(
            "auto (default): run a GGUF file's 4- and 8-bit projections and LM head as stored "
            "where a kernel exists (CPU) for the decode rows; dense-head: the LM head in the "
            "model's dtype; none: dequantized weights only",
            choices=QUANTIZATIONS,
        ),
    ] = "auto"
    # exact | integer: how a GGUF file's stored blocks are multiplied
    gguf_arithmetic: Annotated[
        str,
        EngineFlag(
            "exact (default): a GGUF file's stored weights multiplied in float32, as a dense "
            "product over the dequantized weights to the dtype's rounding; integer: the "
            "activations rounded to 8 bits per block (32 values against Q4_0, Q4_1, Q5_0, "
            "Q5_1 and Q8_0, 256 against Q4_K, Q5_K and Q6_K) and multiplied by the blocks in "
            "integers, llama.cpp's "
            "arithmetic (faster decode; its agreement with "
            "exact: python -m triode.gpu.checks.quant MODEL)",
            choices=GGUF_ARITHMETICS,
        ),
    ] = "exact"
    # what the model is served for (vLLM's `--runner`): auto pools with an encoder (BERT) or a
    # sentence-transformers directory and generates otherwise; pooling serves a decoder's
    # last-token embeddings
    runner: Annotated[
        str,
        EngineFlag(
            "auto (default): embeddings or scores for an encoder or a sentence-transformers "
            "model, text for the rest; generate; pooling: a decoder's last-token embeddings",
            choices=RUNNERS,
        ),
    ] = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # the prompt tokens a step starts new requests with (`SchedulerConfig`); 0: no limit. On
    # 2 CPU cores, a burst of 32 prompts of 37 tokens: median time to first token 179 against
    # 303 ms with no limit, the same output rate
    max_new_prompt_tokens: Annotated[
        int,
        EngineFlag(
            "prompt tokens a step starts new requests with, the first request's whatever it "
            "takes (default 256; 0: up to --max-num-batched-tokens)"
        ),
    ] = 256
    # requests waiting to start in one engine core; past it a new one is refused (the edge
    # answers 429 with Retry-After) instead of queueing without end. 0: no bound. 16x the
    # default max_num_seqs: a queue far longer than a busy server drains in a minute
    max_waiting_requests: Annotated[
        int,
        EngineFlag(
            "requests that may wait to start; past it a new one gets 429 with Retry-After "
            "(default 4096; 0: no bound)"
        ),
    ] = 4096
    # per rank; "auto" (kept as 0, which also means it): a share of the memory the weights
    # leave, sized by the model runner (`gpu/kv_sizing.py`)
    kv_cache_memory: Annotated[
        int | str,
        EngineFlag(
            "auto (default): a share of the memory free once the weights are loaded, 256MiB to "
            "8GiB; or a size per rank, e.g. 512MiB, 2GiB"
        ),
    ] = "auto"
    enable_prefix_caching: bool = True
    tensor_parallel_size: Annotated[int, EngineFlag(short="-tp", group="parallelism")] = 1
    block_size: Annotated[int, NOT_A_FLAG] = 16
    seed: int = 0
    pipeline_parallel_size: Annotated[int, EngineFlag(short="-pp", group="parallelism")] = 1
    # mp: one worker process per rank; inproc: the model in the engine core (a world of one);
    # None: inproc for a world of one, else mp
    distributed_executor_backend: Annotated[
        str | None,
        EngineFlag(
            "mp: a worker process per rank; inproc: the model in the engine core (world of "
            "one only; the default there)",
            choices=EXECUTOR_BACKENDS,
            group="parallelism",
        ),
    ] = None
    nnodes: Annotated[int, EngineFlag("nodes the ranks span", group="parallelism")] = 1
    node_rank: Annotated[int, EngineFlag("this node's index", group="parallelism")] = 0
    master_addr: Annotated[
        str, EngineFlag("rendezvous host: node 0 (default 127.0.0.1)", group="parallelism")
    ] = "127.0.0.1"
    # None: a free port (one node only)
    master_port: Annotated[int | None, EngineFlag("rendezvous port", group="parallelism")] = None
    # seconds a collective of the forward pass may wait for a peer before the engine fails
    distributed_timeout: Annotated[
        float,
        EngineFlag(
            "seconds a collective waits for a peer before the engine fails (default 30)",
            group="parallelism",
        ),
    ] = 30.0
    # the KV connector (disaggregated prefill), vLLM's `--kv-transfer-config`: JSON text or
    # its dict; kept as the dict with defaults filled in (`wire.KVTransferConfig`)
    kv_transfer_config: Annotated[
        dict[str, Any] | str | None,
        EngineFlag(
            'disaggregated prefill, as vLLM spells it: \'{"kv_connector": "TriodeConnector", '
            '"kv_role": "kv_producer|kv_consumer|kv_both", "kv_port": 0, '
            '"kv_connector_extra_config": {"transport": "tcp|shm", "secret_file": PATH}}\'',
            metavar="JSON",
            group="options",
        ),
    ] = None
    # KV-cache events for routers, vLLM's `--kv-events-config`: JSON text or its dict; kept as
    # the dict with defaults filled in (`core.kv_events.KVEventsConfig`)
    kv_events_config: Annotated[
        dict[str, Any] | str | None,
        EngineFlag(
            'KV-cache events for routers, as vLLM spells it: \'{"enable_kv_cache_events": true, '
            '"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": null, "topic": ""}\' '
            "(the endpoints are bound; the events carry prompt token ids)",
            metavar="JSON",
            group="options",
        ),
    ] = None
    # speculative decoding, vLLM's `--speculative-config`: JSON text or its dict; kept as the
    # dict with defaults filled in (`SpeculativeConfig`)
    speculative_config: Annotated[
        dict[str, Any] | str | None,
        EngineFlag(
            'speculative decoding, as vLLM spells it: \'{"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
            'or \'{"method": "suffix", "num_speculative_tokens": 8}\'',
            metavar="JSON",
            group="options",
        ),
    ] = None
    # engine cores, each with its own KV cache, that the edges balance requests over
    data_parallel_size: Annotated[
        int,
        EngineFlag(
            "engine cores, each with its own KV cache (and model workers), that requests are "
            "balanced over",
            short="-dp",
            group="parallelism",
        ),
    ] = 1
    # a directory the engine core records its wire traffic into (`triode replay` reads it);
    # with several data-parallel engines, each records into its `engine-N` subdirectory
    record_wire: Annotated[
        str | None,
        EngineFlag(
            "record every message the engine core takes in and sends out into DIR (a new "
            "directory; 8 rotating files of 64 MiB at most), for `triode replay DIR`",
            metavar="DIR",
        ),
    ] = None
    # where /start_profile and /stop_profile write each rank's torch.profiler trace and the
    # engine core's step timeline (with --enable-admin-api)
    profiler_dir: Annotated[
        str | None,
        EngineFlag(
            "where /start_profile writes each rank's torch.profiler trace and the engine "
            "core's step timeline (Chrome trace JSON)",
            metavar="DIR",
        ),
    ] = None
    # several nodes: the file holding the CurveZMQ key every node shares (`triode cluster-key`)
    cluster_key_file: Annotated[
        str | None,
        EngineFlag(
            "several nodes: the CurveZMQ key every node shares, 0600 (make one with "
            "`triode cluster-key PATH`)",
            metavar="PATH",
            group="parallelism",
        ),
    ] = None
    # a mixture-of-experts model's experts split over the TP group's ranks (whole experts per
    # rank) instead of each expert's intermediate dimension; attention stays tensor-parallel
    enable_expert_parallel: Annotated[
        bool,
        EngineFlag(
            "split a mixture-of-experts model's experts over the tensor-parallel ranks (a "
            "model without experts ignores it)",
            group="parallelism",
        ),
    ] = False

    # the request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens)
    # a request leaves unset, as vLLM takes them (`triode.gpu.generation_config`)
    generation_config: Annotated[
        str,
        EngineFlag(
            "where request defaults come from: auto (default): the model's "
            "generation_config.json, if it has one; vllm: none (temperature 1, top_p 1, top_k "
            "and min_p off); or a directory holding a generation_config.json",
            metavar="auto|vllm|DIR",
            group="options",
        ),
    ] = "auto"
    # JSON text or its dict, kept as the dict: laid over the generation config's defaults
    override_generation_config: Annotated[
        dict[str, Any] | str | None,
        EngineFlag(
            "request defaults laid over --generation-config's, as generation_config.json "
            'spells them: \'{"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0, '
            '"repetition_penalty": 1.05, "max_new_tokens": 512}\'',
            metavar="JSON",
            group="options",
        ),
    ] = None

    # LoRA adapters (vLLM's flags): PEFT adapters over the one base model, mixed in a batch
    enable_lora: Annotated[
        bool, EngineFlag("serve LoRA adapters (--lora-modules, and loaded at run time)")
    ] = False
    # each `name=path` or vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}'
    # (a dict given in Python is kept as that JSON)
    lora_modules: Annotated[
        list[str],
        EngineFlag(
            "LoRA adapters to serve from the start, each name=path or JSON "
            '\'{"name": "n", "path": "p", "base_model_name": "m"}\'',
            metavar="NAME=PATH",
        ),
    ] = []
    max_loras: Annotated[int, EngineFlag("distinct LoRA adapters in one batch (default 1)")] = 1
    max_lora_rank: Annotated[
        int,
        EngineFlag(
            "the highest LoRA rank an adapter may have (default 16; one of "
            f"{', '.join(map(str, LORA_RANKS))})"
        ),
    ] = 16
    # None: max_loras
    max_cpu_loras: Annotated[
        int | None,
        EngineFlag(
            "LoRA adapters kept loaded (default --max-loras; >= it): the least recently used "
            "idle one is dropped, and loaded again when a request asks for it"
        ),
    ] = None
    lora_dtype: Annotated[
        str, EngineFlag("the LoRA weights' dtype (auto: the model's)", choices=DTYPES)
    ] = "auto"
    allowed_lora_paths: Annotated[
        list[str],
        EngineFlag(
            "directories under which LoRA adapters may be loaded at run time "
            "(/v1/load_lora_adapter; the paths of --lora-modules are always allowed)",
            metavar="DIR",
        ),
    ] = []
    allowed_weight_paths: Annotated[
        list[str],
        EngineFlag(
            "directories under which /update_weights_from_disk may read a checkpoint (the "
            "served model's own directory always may)",
            metavar="DIR",
        ),
    ] = []
    # a crashed engine core (or rank) is started again with the same flags, adapters and
    # weights; more deaths than this within the window end the server (0: the first does)
    max_engine_restarts: Annotated[
        int,
        EngineFlag(
            "restarts of a dead engine core within --engine-restart-window; past it the "
            "server exits non-zero (default 5; 0: a dead engine core ends the server)"
        ),
    ] = 5
    engine_restart_window: Annotated[
        float, EngineFlag("seconds over which --max-engine-restarts counts (default 300)")
    ] = 300.0

    def __post_init__(self) -> None:
        memory = self.kv_cache_memory
        self.kv_cache_memory = 0 if memory == "auto" else parse_size(memory)
        self._check_lora()
        if self.kv_transfer_config is not None:
            config = parse_kv_transfer_config(self.kv_transfer_config)
            self.kv_transfer_config = msgspec.to_builtins(config)
        self._check_generation_config()
        if self.kv_events_config is not None:
            self.kv_events_config = msgspec.to_builtins(
                parse_kv_events_config(self.kv_events_config)
            )
        if self.speculative_config is not None:
            config = parse_speculative_config(self.speculative_config)
            self.speculative_config = msgspec.to_builtins(config)
        if self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            choices = ", ".join(QUANTIZATIONS)
            raise ValueError(f"quantization must be one of {choices}, not {self.quantization!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be auto, generate or pooling, not {self.runner!r}")
        if self.gguf_arithmetic not in GGUF_ARITHMETICS:
            raise ValueError(
                f"gguf_arithmetic must be exact or integer, not {self.gguf_arithmetic!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kv_cache_memory < 0:
            raise ValueError("kv_cache_memory must be auto or a size, as 512MiB")
        if self.max_new_prompt_tokens < 0:
            raise ValueError("max_new_prompt_tokens must be >= 0")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.max_engine_restarts < 0 or not self.engine_restart_window > 0:
            raise ValueError("max_engine_restarts must be >= 0, engine_restart_window > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "nnodes",
            "data_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(
                "distributed_executor_backend must be mp or inproc, "
                f"not {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "inproc" and self.world_size > 1:
            raise ValueError(
                "distributed_executor_backend inproc runs a world of one: "
                f"tensor x pipeline parallel size is {self.world_size}; use mp"
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"{self.nnodes} nodes cannot share {self.world_size} ranks evenly "
                "(tensor x pipeline parallel size must be a multiple of nnodes)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes})")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes meet at --master-addr and --master-port: give both")
        if self.nnodes > 1 and self.cluster_key_file is None:
            raise ValueError(f"several nodes need --cluster-key-file: {MAKE_ONE}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError("master_port must be a TCP port")
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError("data parallel engines run on one node: give nnodes 1")
        if self.data_parallel_size > 1 and self.kv_transfer_config is not None:
            raise ValueError(
                "a KV connector serves one engine: give data_parallel_size 1 with "
                "kv_transfer_config"
            )
        if not self.distributed_timeout > 0:
            raise ValueError("distributed_timeout must be > 0")
        if self.record_wire is not None and not self.record_wire.strip():
            raise ValueError("record_wire must name a directory")

    def _check_generation_config(self) -> None:
        """The override as a dict; its keys and values are the engine's to judge (the model's
        side reads generation configs), and `triode serve` has them checked before it starts."""
        if not self.generation_config.strip():
            raise ValueError("generation_config must be auto, vllm or a directory")
        override = self.override_generation_config
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except (ValueError, RecursionError) as e:  # nesting past the parser's depth too
                raise ValueError(f"override_generation_config is not valid JSON: {e}") from None
        if override is not None and not isinstance(override, dict):
            raise ValueError("override_generation_config must be a JSON object")
        self.override_generation_config = override

    def _check_lora(self) -> None:
        # a dict (Python callers) is kept as its JSON: the field crosses to the engine as text
        self.lora_modules = [json.dumps(m) if isinstance(m, dict) else m for m in self.lora_modules]
        if not self.enable_lora:
            given = [
                f"--{name.replace('_', '-')}"
                for name, default in _LORA_DEFAULTS.items()
                if getattr(self, name) != default
            ]
            if given:
                raise ValueError(f"{', '.join(given)} need --enable-lora")
            return
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))}, "
                f"not {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.lora_dtype not in DTYPES:
            raise ValueError(
                f"lora_dtype must be auto, float32, bfloat16 or float16, not {self.lora_dtype!r}"
            )
        for name in ("allowed_lora_paths", "allowed_weight_paths"):
            if any(not isinstance(p, str) or not p.strip() for p in getattr(self, name)):
                raise ValueError(f"{name} must name directories")
        names = [module.name for module in self.lora_module_list()]
        for name in names:
            problem = lora_name_problem(name)
            if problem is not None:
                raise ValueError(f"lora_modules: {problem}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"lora_modules: {', '.join(map(repr, twice))} given more than once")

    def lora_module_list(self) -> list[LoRAModule]:
        """`lora_modules`, each parsed (`parse_lora_module`)."""
        return [parse_lora_module(text) for text in self.lora_modules]

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "inproc" if self.world_size == 1 else "mp"


_LORA_DEFAULTS: dict[str, Any] = {
    "lora_modules": [],
    "max_loras": 1,
    "max_lora_rank": 16,
    "max_cpu_loras": None,
    "lora_dtype": "auto",
    "allowed_lora_paths": [],
}
