"""triode.wire: the protocol between triode's actors and processes.

Message types, the codec (out-of-band array frames), framing for the engine's sockets, control
(handshake) messages, the trio adapter for pyzmq sockets, and the shared-memory ring that
broadcasts each step to the model workers, the KV connector's messages (disaggregated
prefill), recordings of an engine core's traffic, handles of tensors that travel through
shared memory, and free ports for servers and rendezvous to bind. Nothing here imports torch.
"""

from .codec import DEFAULT_AUX_THRESHOLD as DEFAULT_AUX_THRESHOLD
from .codec import Buffer as Buffer
from .codec import Decoder as Decoder
from .codec import Encoder as Encoder
from .errors import ProtocolError as ProtocolError
from .framing import InputDecoder as InputDecoder
from .framing import InputPayload as InputPayload
from .framing import OutputDecoder as OutputDecoder
from .framing import encode_input as encode_input
from .framing import encode_output as encode_output
from .framing import topic_for as topic_for
from .handshake import PROTOCOL_VERSION as PROTOCOL_VERSION
from .handshake import Config as Config
from .handshake import ControlMessage as ControlMessage
from .handshake import Error as Error
from .handshake import Hello as Hello
from .handshake import Ready as Ready
from .handshake import Shutdown as Shutdown
from .kv_transfer import KVConnectorMetadata as KVConnectorMetadata
from .kv_transfer import KVConnectorOutput as KVConnectorOutput
from .kv_transfer import KVExpose as KVExpose
from .kv_transfer import KVGeometry as KVGeometry
from .kv_transfer import KVLoad as KVLoad
from .kv_transfer import KVReply as KVReply
from .kv_transfer import KVRequest as KVRequest
from .kv_transfer import KVShmRef as KVShmRef
from .kv_transfer import KVTransferConfig as KVTransferConfig
from .messages import EngineCoreOutput as EngineCoreOutput
from .messages import EngineCoreOutputs as EngineCoreOutputs
from .messages import EngineCoreRequest as EngineCoreRequest
from .messages import EngineCoreRequestType as EngineCoreRequestType
from .messages import FinishReason as FinishReason
from .messages import Logprobs as Logprobs
from .messages import PoolingParams as PoolingParams
from .messages import SamplingParams as SamplingParams
from .messages import SchedulerStats as SchedulerStats
from .messages import StructuredOutputsParams as StructuredOutputsParams
from .messages import UtilityCall as UtilityCall
from .messages import UtilityOutput as UtilityOutput
from .operations import OperationError as OperationError
from .operations import WorkerCall as WorkerCall
from .operations import WorkerReply as WorkerReply
from .recording import Record as Record
from .recording import Recorder as Recorder
from .recording import open_recorder as open_recorder
from .recording import read_meta as read_meta
from .recording import read_records as read_records
from .ring_wait import RingClosed as RingClosed
from .ring_wait import RingTimeout as RingTimeout
from .shm_ring import ShmRingReader as ShmRingReader
from .shm_ring import ShmRingWriter as ShmRingWriter
from .shm_segment import RingHandle as RingHandle
from .step import ModelRunnerOutput as ModelRunnerOutput
from .step import NewRequestData as NewRequestData
from .step import RequestStepResult as RequestStepResult
from .step import ScheduledRequest as ScheduledRequest
from .step import SchedulerOutput as SchedulerOutput
from .step import WorkerMessageType as WorkerMessageType
from .tensor_ipc import TensorHandle as TensorHandle
from .zsocket import Socket as Socket
