"""The public surface of triode.wire and triode.actors, pinned."""

from __future__ import annotations

import triode.actors
import triode.wire

WIRE = {
    "Buffer", "Config", "ControlMessage", "DEFAULT_AUX_THRESHOLD", "Decoder", "Encoder",
    "EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "EngineCoreRequestType",
    "Error", "FinishReason", "Hello", "InputDecoder", "InputPayload", "Logprobs",
    "OutputDecoder", "PROTOCOL_VERSION", "ProtocolError", "Ready", "SamplingParams",
    "StructuredOutputsParams",
    "SchedulerStats", "Shutdown", "Socket", "UtilityCall", "UtilityOutput", "encode_input",
    "encode_output", "topic_for", "ModelRunnerOutput", "NewRequestData", "RequestStepResult",
    "ScheduledRequest", "SchedulerOutput", "WorkerMessageType", "RingClosed", "RingHandle",
    "RingTimeout", "ShmRingReader", "ShmRingWriter", "KVConnectorMetadata", "KVConnectorOutput",
    "KVExpose", "KVGeometry", "KVLoad", "KVReply", "KVRequest", "KVShmRef", "KVTransferConfig",
    "TensorHandle", "Record", "Recorder", "open_recorder", "read_meta", "read_records",
    "OperationError", "WorkerCall", "WorkerReply", "PoolingParams",
}  # fmt: skip
ACTORS = {
    "ActorDied", "ActorError", "Child", "ChildContext", "HandshakeError", "RemoteError",
    "RestartBudget", "SamplingParams", "ZmqReceiveChannel", "ZmqSendChannel", "open_child",
    "CompletionOutput",
    "Engine", "EngineArgs", "EngineDeadError", "RequestError", "RequestOutput", "TokenLogprob",
    "RequestRefused", "EngineFlag", "LoRAModule", "lora_name_problem", "parse_lora_module",
    "open_engine", "EngineAdmin", "OperationError", "EngineCoreStartError", "EngineCoreFailed",
    "EngineRestarting",
    "Bridge", "EngineCoreEndpoint", "Intake", "UntrustedRecordingError", "check_grammar",
    "check_prompt_embeds", "connect_engine", "describe_prompt_embeds", "grammar_of",
    "open_bridge", "open_engine_cores", "out_of_vocabulary", "parse_size", "replay",
    "serve_headless", "transfer_params_error", "MAX_POOLING_INPUTS", "PooledOutput",
}  # fmt: skip


def _public(module: object) -> set[str]:
    return {n for n in vars(module) if not n.startswith("_")} - {
        n for n, v in vars(module).items() if type(v).__name__ == "module"
    }


def test_wire_exports_exactly_the_protocol() -> None:
    assert _public(triode.wire) == WIRE


def test_actors_exports_exactly_the_runtime() -> None:
    assert _public(triode.actors) == ACTORS
