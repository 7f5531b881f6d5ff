"""triode.actors: the actor runtime and, on top of it, triode's actors.

An actor is a trio task tree with a typed inbox. Inside a process its edges are bounded trio
memory channels; across processes they are ZMQ sockets wrapped as the same `trio.abc` channels.
`open_child` runs an actor in a child process under the caller's supervision; `open_engine`
starts an engine core that way and serves `generate` calls from the caller's trio run.
"""

from triode.wire import SamplingParams as SamplingParams

from .channels import ZmqReceiveChannel as ZmqReceiveChannel
from .channels import ZmqSendChannel as ZmqSendChannel
from .child import ChildContext as ChildContext
from .config import EngineArgs as EngineArgs
from .core_client import EngineDeadError as EngineDeadError
from .engine import Engine as Engine
from .engine import RequestError as RequestError
from .engine import RequestRefused as RequestRefused
from .engine import open_engine as open_engine
from .errors import ActorDied as ActorDied
from .errors import ActorError as ActorError
from .errors import HandshakeError as HandshakeError
from .errors import RemoteError as RemoteError
from .outputs import CompletionOutput as CompletionOutput
from .outputs import RequestOutput as RequestOutput
from .outputs import TokenLogprob as TokenLogprob
from .process import Child as Child
from .process import open_child as open_child
