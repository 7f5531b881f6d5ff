"""triode.actors: the actor runtime and, on top of it, triode's actors.

An actor is a trio task tree with a typed inbox. Inside a process its edges are bounded trio
memory channels; across processes they are ZMQ sockets wrapped as the same `trio.abc` channels.
`open_child` runs an actor in a child process under the caller's supervision; `open_engine`
starts an engine core that way and serves `generate` calls from the caller's trio run.

What this module exports is the edge's whole view of the engine: the engine client, the servers'
engine cores (`open_engine_cores`, `connect_engine`, `serve_headless`), and the checks a request
gets before it leaves for one (`transfer_params_error`, `check_grammar`, `check_prompt_embeds`,
`out_of_vocabulary`, `lora_name_problem`), and how `--lora-modules` entries read
(`parse_lora_module`).
"""

from triode.wire import OperationError as OperationError
from triode.wire import SamplingParams as SamplingParams

from .admin import EngineAdmin as EngineAdmin
from .asyncio import Bridge as Bridge
from .asyncio import open_bridge as open_bridge
from .channels import ZmqReceiveChannel as ZmqReceiveChannel
from .channels import ZmqSendChannel as ZmqSendChannel
from .child import ChildContext as ChildContext
from .config import EngineArgs as EngineArgs
from .config import EngineFlag as EngineFlag
from .config import parse_size as parse_size
from .core_client import EngineDeadError as EngineDeadError
from .core_client import EngineRestarting as EngineRestarting
from .engine import Engine as Engine
from .engine import connect_engine as connect_engine
from .engine import open_engine as open_engine
from .errors import ActorDied as ActorDied
from .errors import ActorError as ActorError
from .errors import HandshakeError as HandshakeError
from .errors import RemoteError as RemoteError
from .errors import RequestError as RequestError
from .errors import RequestRefused as RequestRefused
from .grammar import check_grammar as check_grammar
from .grammar import grammar_of as grammar_of
from .headless import serve_headless as serve_headless
from .intake import Intake as Intake
from .kv_params import transfer_params_error as transfer_params_error
from .launcher import EngineCoreEndpoint as EngineCoreEndpoint
from .launcher import EngineCoreFailed as EngineCoreFailed
from .launcher import EngineCoreStartError as EngineCoreStartError
from .launcher import open_engine_cores as open_engine_cores
from .lora_modules import LoRAModule as LoRAModule
from .lora_modules import lora_name_problem as lora_name_problem
from .lora_modules import parse_lora_module as parse_lora_module
from .outputs import CompletionOutput as CompletionOutput
from .outputs import RequestOutput as RequestOutput
from .outputs import TokenLogprob as TokenLogprob
from .pooling import MAX_POOLING_INPUTS as MAX_POOLING_INPUTS
from .pooling import PooledOutput as PooledOutput
from .process import Child as Child
from .process import RestartBudget as RestartBudget
from .process import open_child as open_child
from .prompt_embeds import check_prompt_embeds as check_prompt_embeds
from .prompt_embeds import describe_prompt_embeds as describe_prompt_embeds
from .vocabulary import out_of_vocabulary as out_of_vocabulary
from .wire_replay import UntrustedRecordingError as UntrustedRecordingError
from .wire_replay import replay as replay
