"""LoRA adapters on a rank: PEFT directories read and checked (`adapter`, `files`), kept by id
(`store`), and their deltas added to a mixed batch's projections (`punica`).

This package's top level is torch-free, for the engine core: `adapter_digest` (what prefix
caching keys an adapter's blocks by) and `lora_config_of` (the runner's `lora_config` from an
engine's arguments).
"""

from .config import LoraLimits as LoraLimits
from .config import lora_config_of as lora_config_of
from .files import adapter_digest as adapter_digest
