"""Weights from a trainer into a running server: the engine ranks' side (`WeightTransfer`,
which `Operations` owns, and the backends under it: `shm` and `broadcast`) and the trainer's
(`client.WeightSyncClient`, imported from its module: the engine has no use for its HTTP
client). `triode.wire.weight_update` holds what the HTTP calls carry."""

from .broadcast import BroadcastGroup as BroadcastGroup
from .broadcast import Rendezvous as Rendezvous
from .broadcast import TrainerGroup as TrainerGroup
from .shm import mapped_weights as mapped_weights
from .shm import write_bucket as write_bucket
from .transfer import WeightTransfer as WeightTransfer
