"""Decode steps replayed from a recording: the CPU analogue of vLLM's CUDA graphs.

A decode step of a small model is hundreds of short kernel calls; made from Python one by one
(module calls, ctypes argument conversion, a fresh output tensor each) they cost as much as the
matmuls (Qwen2.5-0.5B w4a8, 2 threads: ~8 ms of a ~21 ms step). So the first decode step of each
batch size (up to `MAX_GRAPH_BATCH` sequences) runs with `ops.capture()` on: the kernel calls
execute as usual and are recorded, with every tensor they touch kept alive. Later steps of that
size write their token ids, positions, cache slots, context lengths and block tables into the
graph's input buffers and replay the calls with one C call (csrc/graph.cpp).

A step that runs any PyTorch op that computes (rather than allocates or makes a view) cannot be
replayed; capture notices (ops.capture's dispatch guard) and steps of that batch size stay
eager. `enforce_eager=True` (vLLM's flag) turns graphs off.
"""

from __future__ import annotations

import logging

import torch

from armserve import ops
from armserve.layers.attention import AttentionMetadata, set_attention_metadata

logger = logging.getLogger("armserve")

# Decode batches up to this size are replayed; beyond it the Python overhead per step is shared
# by enough tokens not to matter, and every size would hold its own activations and logits.
MAX_GRAPH_BATCH = 8


class StepGraph:
    """One batch size's decode step: input buffers, the recorded calls and the logits they fill."""

    def __init__(self, batch: int, max_blocks: int, block_size: int) -> None:
        self.batch = batch
        self.block_size = block_size
        self.ids = torch.zeros(batch, dtype=torch.long)
        self.positions = torch.zeros(batch, dtype=torch.long)
        self.slots = torch.zeros(batch, dtype=torch.long)
        self.q_start = torch.arange(batch, dtype=torch.int32)
        self.q_len = torch.ones(batch, dtype=torch.int32)
        self.context_len = torch.zeros(batch, dtype=torch.int32)
        self.block_tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
        self.attn_batch = ops.make_attn_batch(self.q_start, self.q_len, self.context_len, self.block_tables,
                                              block_size)
        self._ids, self._positions, self._slots = self.ids.numpy(), self.positions.numpy(), self.slots.numpy()
        self._context_len, self._block_tables = self.context_len.numpy(), self.block_tables.numpy()
        self.recording: ops.Recording | None = None
        self.logits: torch.Tensor | None = None
        self.generation = ops.kernel_generation

    def set_inputs(self, ids: list[int], positions: list[int], block_ids: list[list[int]]) -> None:
        """This step's tokens (one per sequence), their positions and each sequence's blocks."""
        bs = self.block_size
        # Through numpy views of the buffers: a few microseconds, where a torch.tensor per field
        # cost more than the rest of the step's Python.
        self._ids[:] = ids
        self._positions[:] = positions
        self._slots[:] = [b[p // bs] * bs + p % bs for b, p in zip(block_ids, positions)]
        self._context_len[:] = [p + 1 for p in positions]
        for r, (b, p) in enumerate(zip(block_ids, positions)):
            n = p // bs + 1  # blocks holding positions 0..p
            self._block_tables[r, :n] = b[:n]

    def capture(self, model) -> torch.Tensor:
        """Run the step eagerly while recording it; returns its float32 logits [batch, vocab]."""
        md = AttentionMetadata(slot_mapping=self.slots, num_decodes=self.batch)
        md.kernel_batch = self.attn_batch
        set_attention_metadata(md)
        try:
            with ops.capture() as rec:
                logits = model.compute_logits(model(self.ids, self.positions))
        finally:
            set_attention_metadata(None)
        if logits.dtype != torch.float32 or tuple(logits.shape) != (self.batch, model.config.vocab_size):
            rec.errors.append(f"logits are {logits.dtype} {tuple(logits.shape)}")
        self.recording, self.logits = rec, logits
        return logits

    @property
    def replayable(self) -> bool:
        return self.recording is not None and not self.recording.errors

    def replay(self) -> torch.Tensor:
        """Re-run the recorded step on the current inputs; returns the logits buffer (overwritten
        by the next replay, so consume it first)."""
        ops.run_graph(self.recording)
        return self.logits


class StepGraphs:
    """The model runner's graphs, one per decode batch size, captured on first use."""

    def __init__(self, model, max_blocks: int, block_size: int, enabled: bool) -> None:
        self.model = model
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.enabled = enabled  # the runner's: kernels on and not enforce_eager
        self.graphs: dict[int, StepGraph] = {}
        self.replays = 0  # decode steps served by a replay (tests, stats)

    def run(self, ids: list[int], positions: list[int], block_ids: list[list[int]]) -> torch.Tensor | None:
        """Logits of a decode step, from a graph (replayed, or captured now); None when this step
        must run eagerly (graphs off, batch too large, or the model not capturable)."""
        n = len(ids)
        if not self.enabled or n > MAX_GRAPH_BATCH:
            return None
        g = self.graphs.get(n)
        if g is not None and g.generation != ops.kernel_generation:
            self.graphs.clear()  # the kernel variant changed since capture: record again
            g = None
        if g is None:
            g = StepGraph(n, self.max_blocks, self.block_size)
            self.graphs[n] = g
            g.set_inputs(ids, positions, block_ids)
            logits = g.capture(self.model)
            if not g.replayable:
                # e.g. a float16 model's matmuls beyond the skinny kernel's token limit go to
                # PyTorch (bfloat16 ones run the dense GEMM at any size): that batch size stays eager
                logger.info("decode steps of %d sequences run eagerly: the step cannot be replayed (%s)", n,
                            ", ".join(sorted(set(g.recording.errors))[:5]))
                g.recording.keep.clear()
                g.logits = None
            return logits  # computed eagerly while recording
        if not g.replayable:
            return None
        g.set_inputs(ids, positions, block_ids)
        self.replays += 1
        return g.replay()
