"""Sparse mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral).

A router (one replicated [experts, hidden] projection) scores every expert for each token; the
softmax over them is taken in float32 and the top k kept, renormalised to sum to one where the
family does (Mixtral always, Qwen3-MoE with `norm_topk_prob`). Each expert is a SiLU-gated MLP;
their weights are stacked, `w13` [experts, 2 x intermediate, hidden] (gate rows, then up rows)
and `w2` [experts, hidden, intermediate].

The experts run grouped: a step's (token, choice) pairs are sorted by expert, and each expert
with pairs takes its rows in one gathered product per projection. Each pair's output lands in
its place in a [tokens, k, hidden] buffer and the routing weights sum a token's k outputs in
choice order: the same order every run, where a scatter-add's may vary on a GPU.

Tensor parallelism splits every expert's intermediate dimension over the TP group (w13's rows,
w2's columns) and sums the partial outputs with one all-reduce. Expert parallelism
(`parallel_state.expert_parallel`) gives each rank of the TP group whole experts instead, E/tp of
them, while attention stays tensor-parallel. The hidden states reaching the block are the same
on every rank of the group, so there are two ways to bring each token to its experts:

- "allreduce": every rank routes every token, computes the pairs of its own experts and one
  all-reduce sums the ranks' outputs (what an all-gather of the tokens and a reduce-scatter of
  the results amount to when the tokens are replicated anyway);
- "all_to_all": each rank routes its 1/tp of the tokens, sends each pair to the rank holding
  its expert (`all_to_all_single`), computes what it receives, sends the results back, and an
  all-gather gives every rank all the tokens again.

Measured with `python -m triode.gpu.bench.moe --rounds 9` (gloo, 2 ranks of 1 thread on a
shared 2-core machine, load about 3; 64 experts of intermediate size 256, top 4, hidden 1024,
float32; the median ms of one block forward, the splits timed in turn):

| tokens | TP=1 | TP=2 | EP allreduce | EP all_to_all |
|---:|---:|---:|---:|---:|
| 1 | 3.3 | 4.4 | 2.2 | 7.9 |
| 8 | 18.0 | 11.8 | 11.7 | 16.7 |
| 64 | 70.2 | 41.7 | 40.5 | 45.2 |
| 256 | 132.8 | 149.6 | 138.2 | 143.2 |

Both dispatches compute the same (token, expert) pairs on the same ranks, so they differ only
in what they exchange: "allreduce" one [tokens, hidden] sum (through the shared-memory
all-reduce on the CPU), "all_to_all" four collectives (counts, rows out, rows back, the
all-gather), each a gloo round trip of its own: 3.6x slower at one token, and slower at every
size in this run and the runs around it, so "allreduce" is the default (`DEFAULT_DISPATCH`).
From a few tokens on a step reads most experts' weights: the block's time is memory traffic,
which two ranks on two shared cores split only while the machine is otherwise quiet.

A GGUF file's experts run as the file stores them (`Experts.attach_stored`): each expert's
gate and up rows stacked and its down rows, read where they lie by the CPU kernels, one product
per projection and expert with rows (llama.cpp's `mul_mat_id` as a loop over the experts),
with no dense copy; a weight update dequantizes them first, as a projection's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import parallel_state
from ..gguf_weight import GgufWeight, Packed
from ..layers import SiluAndMul, divide, tp_rank, tp_size
from ..quant_matmul import Quantized, QuantRows, quantized_kernel
from .architectures import CheckpointMismatch
from .llama import LlamaForCausalLM

Dispatch = Literal["allreduce", "all_to_all"]
DEFAULT_DISPATCH: Dispatch = "allreduce"

# (expert index in the checkpoint, "gate" | "up" | "down"): where one expert's tensor goes
ExpertShard = tuple[int, str]


class Router(nn.Module):
    """The gate: [experts, hidden], replicated on every rank (every rank routes alike)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert indices [T, k]) of each token's top-k experts."""
        logits = F.linear(hidden, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


class Experts(nn.Module):
    """This rank's experts, stacked: the `count` experts from `first` on (all of them but
    `intermediate_size / tp` of each under tensor parallelism; E/tp whole ones under expert
    parallelism)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, expert_parallel: bool
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.expert_parallel = expert_parallel
        if expert_parallel:
            if num_experts < self.tp_size:
                raise ValueError(f"{num_experts} experts cannot be split over {self.tp_size} ranks")
            parts = parallel_state.partition(num_experts, self.tp_size)
            self.first, self.count = parts[self.tp_rank]
            self.intermediate_size = intermediate_size
        else:
            self.first, self.count = 0, num_experts
            self.intermediate_size = divide(intermediate_size, self.tp_size)
        local = self.intermediate_size
        self.w13 = self._parameter((self.count, 2 * local, hidden_size))
        self.w2 = self._parameter((self.count, hidden_size, local))
        self.act_fn = SiluAndMul()
        # the local experts as the GGUF file stores them (`attach_stored`): per expert, the
        # kernels of its gate-and-up rows and of its down rows, and those weights
        self.expert_kernels: list[tuple[QuantRows, QuantRows]] | None = None
        self.stored: list[tuple[Packed, Packed]] | None = None

    def attach_stored(
        self, weights: list[tuple[GgufWeight, GgufWeight, GgufWeight]], integer: bool
    ) -> bool:
        """Run each local expert from its (gate, up, down) weights as the GGUF file stores them
        (this rank's cut of each under tensor parallelism; `integer`: in the integer mode where
        a type has one); whether the kernels took every expert (else nothing changes: a cut
        inside a block, a type no kernel runs)."""
        size, hidden = self.intermediate_size, self.w2.shape[1]
        dtype = self.w13.dtype
        kernels, stored = [], []
        try:
            for gate, up, down in weights:
                if not self.expert_parallel and self.tp_size > 1:
                    start = self.tp_rank * size
                    gate, up = gate.rows(start, size), up.rows(start, size)
                    down = down.columns(start, size)
                gate_up = GgufWeight.cat([gate, up])
                if gate_up.shape != (2 * size, hidden) or down.shape != (hidden, size):
                    return False
                first = quantized_kernel(gate_up, dtype, integer)
                second = quantized_kernel(down, dtype, integer)
                if not isinstance(first, QuantRows) or not isinstance(second, QuantRows):
                    return False
                kernels.append((first, second))
                stored.append((gate_up, down))
        except ValueError:  # a cut inside a block
            return False
        self.expert_kernels, self.stored = kernels, stored
        return True

    def detach_quantized(self) -> bool:
        """Drop the file's experts, dequantized into the stacked weights first where they were
        the only copy (a weight update writes them); whether there were any."""
        had = self.expert_kernels is not None
        if had and self.w13.numel() == 0 and self.stored is not None:
            dtype = self.w13.dtype
            self.w13.data = torch.stack([w.dequantize() for w, _ in self.stored]).to(dtype)
            self.w2.data = torch.stack([w.dequantize() for _, w in self.stored]).to(dtype)
        self.expert_kernels = self.stored = None
        return had

    def _parameter(self, shape: tuple[int, ...]) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape), requires_grad=False)
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        return param

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard: ExpertShard
    ) -> None:
        """Copy one expert's checkpoint projection (gate or up [I, hidden], down [hidden, I])
        into its place: this rank's slice of I under tensor parallelism, all of it under
        expert parallelism. ValueError for an expert this rank does not hold (the model's
        `checkpoint_targets` sends those nowhere)."""
        expert, part = shard
        if not self.holds(expert):
            raise ValueError(f"expert {expert} is not on this rank")
        size = self.intermediate_size
        dim = 1 if part == "down" else 0
        if not self.expert_parallel and self.tp_size > 1:
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * size, size)
        target = param.data[expert - self.first]
        if part in ("gate", "up"):
            target = target.narrow(0, 0 if part == "gate" else size, size)
        if target.shape != loaded_weight.shape:
            raise CheckpointMismatch(
                f"expert {expert} {part}: {tuple(loaded_weight.shape)} for a "
                f"{tuple(target.shape)} slot"
            )
        target.copy_(loaded_weight)

    def forward(
        self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Σ over each token's k choices held here of weight x expert(token): [T, hidden] in
        `hidden`'s dtype, zero where no choice is held here."""
        tokens, k = experts.shape
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = sum(counts[: self.first])
        local = counts[self.first : self.first + self.count]
        pairs = order[start : start + sum(local)]  # (token, choice) pair indices, by expert
        outputs = hidden.new_zeros(tokens * k, hidden.shape[1])
        outputs[pairs] = self.compute(hidden[pairs // k], local)
        return weighted_sum(outputs, weights)

    def compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each local expert applied to its run of `rows` (sorted by expert, `counts[i]` rows
        for local expert i): one product per projection and expert (the file's blocks where
        they run), or, where most dense experts have rows, one batched product per projection
        over all of them (`_batched`)."""
        active = sum(1 for n in counts if n)
        kernels = self.expert_kernels
        batched = active * BATCHED_SHARE >= len(counts) and max(counts) <= BATCHED_ROWS
        if kernels is None and 1 < active and batched:
            return self._batched(rows, counts)
        parts, offset = [], 0
        for i, n in enumerate(counts):
            if n == 0:
                continue
            x = rows[offset : offset + n]
            if kernels is not None:  # the file's blocks
                gate_up, down = kernels[i]
                parts.append(down.in_turns(self.act_fn(gate_up.in_turns(x))))
            else:
                parts.append(F.linear(self.act_fn(F.linear(x, self.w13[i])), self.w2[i]))
            offset += n
        if not parts:
            return rows.new_empty(0, rows.shape[1])  # [0, hidden]
        return torch.cat(parts)

    def _batched(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`compute` as two `bmm`s over every local expert: each expert's rows laid in a
        [experts, most rows, hidden] grid, zero-padded, against the stacked weights as they
        are (no copy). A decode step's few rows per expert leave a product bound by reading
        the weights, which one batched call does at 1.7-1.8x the rate of a product per expert
        (64 experts of [512, 1024] float32, 2 cores: 10 against 5.9 GB/s at 2 rows each, 6.4
        against 3.5 at 4); the padding's arithmetic costs nothing there."""
        experts, width, hidden = len(counts), max(counts), rows.shape[1]
        sizes = torch.tensor(counts, device=rows.device)
        owner = torch.repeat_interleave(torch.arange(experts, device=rows.device), sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        slots = owner * width + torch.arange(rows.shape[0], device=rows.device) - starts[owner]
        grid = rows.new_zeros(experts * width, hidden)
        grid[slots] = rows
        gate_up = torch.bmm(grid.view(experts, width, hidden), self.w13.transpose(1, 2))
        inner = self.act_fn(gate_up.view(experts * width, -1)).view(experts, width, -1)
        out = torch.bmm(inner, self.w2.transpose(1, 2))
        return out.view(experts * width, hidden)[slots]


# the batched product (`Experts._batched`) once at least 1 / BATCHED_SHARE of the experts have
# rows (it reads every expert's weights, so with fewer it would read more than the loop does)
# and none has more than BATCHED_ROWS: past a few rows the products are no longer bound by the
# weights' bytes, and the grid's padding to the busiest expert (a prompt's rows spread unevenly)
# would be arithmetic paid for nothing
BATCHED_SHARE = 2
BATCHED_ROWS = 8


def weighted_sum(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, hidden]: each token's k outputs (`outputs` [T * k, hidden], token t's choice j at
    row t * k + j) weighted by `weights` [T, k] and summed, in the outputs' dtype."""
    tokens, k = weights.shape
    scaled = outputs.view(tokens, k, outputs.shape[-1]) * weights.to(outputs.dtype).unsqueeze(-1)
    return scaled.sum(dim=1)


class SparseMoeBlock(nn.Module):
    """The feed-forward block of a mixture-of-experts layer: `gate` (the router) and `experts`,
    as the checkpoints name them."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        *,
        expert_parallel: bool,
        dispatch: Dispatch = DEFAULT_DISPATCH,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, renormalize)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, expert_parallel)
        self.dispatch = dispatch

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        if experts.expert_parallel and experts.tp_size > 1 and self.dispatch == "all_to_all":
            return self._all_to_all(hidden)
        weights, chosen = self.gate(hidden)
        out = experts(hidden, weights, chosen)
        if experts.tp_size > 1:
            parallel_state.tp_all_reduce(out)
        return out

    def _all_to_all(self, hidden: torch.Tensor) -> torch.Tensor:
        """Expert parallelism by exchange: this rank's share of the tokens goes to the experts'
        ranks and back, then every rank gathers every share."""
        experts, group = self.experts, parallel_state.get().tp_group
        size, rank = experts.tp_size, experts.tp_rank
        shares = parallel_state.partition(hidden.shape[0], size, allow_empty=True)
        start, count = shares[rank]
        mine = hidden[start : start + count]
        weights, chosen = self.gate(mine)
        k = chosen.shape[1]
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts.num_experts)
        # each rank learns how many of this rank's pairs go to each of its experts
        held = parallel_state.partition(experts.num_experts, size)
        received = counts.new_empty(size * experts.count)
        split = [n for _, n in held]
        dist.all_to_all_single(received, counts, [experts.count] * size, split, group=group)
        per_source = received.view(size, experts.count)
        pairs = counts.tolist()
        send_rows = [sum(pairs[first : first + n]) for first, n in held]
        recv_rows = per_source.sum(dim=1).tolist()
        rows = hidden.new_empty(sum(recv_rows), hidden.shape[1])
        dist.all_to_all_single(rows, mine[order // k], recv_rows, send_rows, group=group)
        # the rows come by source, each source's by expert: regroup them by expert
        local = torch.arange(experts.count, device=hidden.device).repeat(size)
        by_expert = torch.argsort(torch.repeat_interleave(local, per_source.flatten()), stable=True)
        results = torch.empty_like(rows)
        results[by_expert] = experts.compute(rows[by_expert], per_source.sum(dim=0).tolist())
        back = hidden.new_empty(count * k, hidden.shape[1])
        dist.all_to_all_single(back, results, send_rows, recv_rows, group=group)
        outputs = torch.empty_like(back)
        outputs[order] = back
        part = hidden.new_zeros(max(n for _, n in shares), hidden.shape[1])
        part[:count] = weighted_sum(outputs, weights)
        gathered = [torch.empty_like(part) for _ in range(size)]
        dist.all_gather(gathered, part, group=group)
        return torch.cat([g[:n] for g, (_, n) in zip(gathered, shares, strict=True)])


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-shaped decoder whose layers may hold a `SparseMoeBlock` (as `mlp`): loads each
    expert's checkpoint tensors into the stacked weights of the rank that holds the expert."""

    moe_block = "mlp"  # the block's name in the checkpoint (Mixtral's: block_sparse_moe)
    # the checkpoint's name of an expert's projection -> its part ("gate", "up", "down")
    expert_parts: dict[str, str] = {}

    def checkpoint_targets(self, name: str) -> list[tuple[str, str | int | None]]:
        """As `LlamaForCausalLM.checkpoint_targets`; an expert's tensor goes to its stacked
        parameter with an `ExpertShard`, or nowhere on a rank that does not hold the expert.
        A tensor of an expert the config does not have, or of a dense layer, has no home."""
        parts = self._parts(name)
        layer = parts[2] if len(parts) > 2 else ""
        expert = self._expert(parts)
        if expert is None or self._elsewhere(name):
            return super().checkpoint_targets(".".join(parts))
        index, part = expert
        block = self.model.layers[int(layer)].mlp
        if not isinstance(block, SparseMoeBlock) or index >= block.experts.num_experts:
            return [(name, None)]
        if not block.experts.holds(index):
            return []
        param = "w2" if part == "down" else "w13"
        return [(f"model.layers.{layer}.mlp.experts.{param}", (index, part))]  # type: ignore[list-item]

    def _parts(self, name: str) -> list[str]:
        """A checkpoint name's dotted parts, the family's MoE block named `mlp` as ours is."""
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[3] == self.moe_block:
            parts[3] = "mlp"
        return parts

    def _expert(self, parts: list[str]) -> ExpertShard | None:
        """(expert, part) of `model.layers.L.mlp.experts.E.PROJ.weight`, else None."""
        if len(parts) != 8 or parts[4] != "experts" or parts[7] != "weight":
            return None
        if parts[:2] != ["model", "layers"] or parts[3] != "mlp" or not parts[5].isdigit():
            return None
        part = self.expert_parts.get(parts[6])
        return None if part is None else (int(parts[5]), part)

    def attach_quantized_weights(
        self, weights: Mapping[str, Quantized], integer: bool = False
    ) -> tuple[int, set[str]]:
        """`LlamaForCausalLM.attach_quantized_weights`, and each MoE layer's experts where the
        file stores every one this rank holds (gate, up and down) and the kernels take them
        (`Experts.attach_stored`): a layer counts as one projection."""
        count, taken = super().attach_quantized_weights(weights, integer)
        by_layer: dict[int, dict[int, dict[str, tuple[str, Quantized]]]] = {}
        for name, weight in weights.items():
            parts = self._parts(name)
            expert = self._expert(parts)
            if expert is not None and isinstance(weight, GgufWeight):
                index, part = expert
                by_layer.setdefault(int(parts[2]), {}).setdefault(index, {})[part] = (name, weight)
        model = self.model
        for layer, experts in by_layer.items():
            block = (
                model.layers[layer].mlp if model.start_layer <= layer < model.end_layer else None
            )
            if not isinstance(block, SparseMoeBlock):
                continue
            held = range(block.experts.first, block.experts.first + block.experts.count)
            if not all(set(experts.get(e, ())) == {"gate", "up", "down"} for e in held):
                continue
            triples = [tuple(experts[e][p][1] for p in ("gate", "up", "down")) for e in held]
            if block.experts.attach_stored(triples, integer):  # type: ignore[arg-type]
                count += 1
                taken |= {name for e in held for name, _ in experts[e].values()}
        return count, taken

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        partial: bool = False,
        held: Iterable[str] = (),
    ) -> set[str]:
        """`LlamaForCausalLM.load_weights`, which also raises, unless `partial`, where an
        expert's projection that this rank holds has no tensor (nor the GGUF file's blocks:
        `held`)."""
        held = set(held)
        filled: set[tuple[str, object]] = set()

        def noting() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                filled.update(t for t in self.checkpoint_targets(name) if isinstance(t[1], tuple))
                yield name, tensor

        loaded = super().load_weights(noting(), partial=partial, held=held)
        if not partial:
            missing = [s for s in self._expert_slots() if s not in filled and s[0] not in held]
            if missing:
                raise CheckpointMismatch(f"checkpoint lacks experts' weights: {missing[:4]}")
        return loaded

    def _expert_slots(self) -> Iterator[tuple[str, ExpertShard]]:
        model = self.model
        for i in range(model.start_layer, model.end_layer):
            block = model.layers[i].mlp
            if isinstance(block, SparseMoeBlock):
                first, count = block.experts.first, block.experts.count
                for expert in range(first, first + count):
                    prefix = f"model.layers.{i}.mlp.experts"
                    yield f"{prefix}.w13", (expert, "gate")
                    yield f"{prefix}.w13", (expert, "up")
                    yield f"{prefix}.w2", (expert, "down")
