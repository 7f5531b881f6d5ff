"""A GGUF file's stacked experts read in place: each expert's rows of `ffn_gate_exps`,
`ffn_up_exps` and `ffn_down_exps` ([experts, out, in] of one type, one expert's rows after
another's) are that expert's projection as a model directory names it.

Which checkpoint tensor each expert's rows are is found by running the family's own mapping
(transformers' tensor processor, then its reverse conversion to the checkpoint's names, as the
dense weights go) on the rows' indices instead of their values: a mapping that does more than
hand each expert's rows over whole and in order leaves the stack to the dense weights.

numpy, torch and transformers are imported lazily, inside the function: a conversion's imports.
"""

from __future__ import annotations

import re
from typing import Any

from .gguf_weight import GgufWeight

EXPERT_STACK = re.compile(r"\.ffn_(gate|up|down)_exps\.weight$")


def expert_entries(
    processor: Any, names: dict[str, str], skeleton: Any, tensor: Any
) -> tuple[list[dict[str, Any]], set[str]] | None:
    """The manifest entries of stacked-experts tensor `tensor` (a GGUF reader's tensor), one per
    expert, and the model's parameters they fill; None where the mapping does more than name
    each expert's rows."""
    # a conversion's imports, as the module says
    import numpy as np
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    if not EXPERT_STACK.search(tensor.name):
        return None
    kind = int(tensor.tensor_type)
    cols, rows, experts = (int(d) for d in tensor.shape)
    index = np.arange(1, experts * rows + 1, dtype=np.float64).reshape(experts, rows, 1)
    parsed: dict[str, Any] = {"tensors": {}}
    try:
        result = processor.process(
            weights=index, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
    except Exception:  # a processor that needs the values: the stack stays dense
        return None
    filled: dict[str, Any] = dict(parsed["tensors"])
    if result.name in names:
        filled[names[result.name]] = torch.from_numpy(np.array(result.weights))
    if not filled:
        return None
    entries = []
    row_bytes = GgufWeight.row_bytes(kind, cols)
    for name, weights in revert_weight_conversion(skeleton, filled).items():
        values = weights.double().flatten().numpy()
        if not values.any():
            continue  # another stack's half of a merged parameter
        first = int(values[0]) - 1
        expert, row = divmod(first, rows)
        whole = np.arange(first + 1, first + rows + 1, dtype=np.float64)
        if weights.shape != (rows, 1) or row or not np.array_equal(values, whole):
            return None
        offset = int(tensor.data_offset) + expert * rows * row_bytes
        entries.append({"name": name, "kind": kind, "offset": offset, "rows": rows, "cols": cols})
    if len(entries) != experts:
        return None
    return entries, set(filled)
