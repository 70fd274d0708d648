"""Decode steps replayed from a recording: the CPU analogue of vLLM's CUDA graphs.

A decode step of a small model is hundreds of short kernel calls; made from Python one by one
(module calls, ctypes argument conversion, a fresh output tensor each) they cost as much as the
matmuls (Qwen2.5-0.5B w4a8, 2 threads: ~8 ms of a ~21 ms step). So the first decode step of each
batch size (up to `MAX_GRAPH_BATCH` sequences) runs with `capture.recording()` on: the kernel calls
execute as usual and are recorded, with every tensor they touch kept alive. Later steps of that
size write their token ids, positions, cache slots, context lengths and block tables into the
graph's input buffers and replay the calls with one C call (csrc/graph.cpp).

A speculative-decoding step that verifies drafts (engine/spec_decode.py) has 1 + k query rows per
sequence; it is replayed the same way from a graph per (sequences, rows per sequence), each
sequence's rows padded to the step's longest run of drafts: a padding row comes after the real
ones (so causal attention keeps it out of theirs) and writes its key and value to the spare block.

A step in which some sequence runs a LoRA adapter has graphs of its own (`lora_graphs`): their
recording includes the adapters' shrink/expand calls, whose per-token slots are one more input
buffer, and the slots' weights are rewritten in place when an adapter moves in (layers/lora.py).

All graphs keep their tensors in one arena (kernels/capture.py's Arena), as vLLM's CUDA graphs
share a memory pool: the runner replays one graph at a time and a replay recomputes every tensor
it allocated, so the graphs of all sizes hold the largest one's bytes, not their sum; and each
recording is packed by lifetime (Recording.pack: a layer's activations reuse the bytes of the
layers before). A graph's logits are therefore valid until the runner's next step.

A step that runs any PyTorch op that computes (rather than allocates or makes a view) cannot be
replayed; capture notices (kernels/capture.py's dispatch guard) and steps of that batch size stay
eager. `enforce_eager=True` (vLLM's flag) turns graphs off.
"""

from __future__ import annotations

import logging

import torch

from armserve import kernels
from armserve.kernels import capture, library
from armserve.layers.attention import AttentionMetadata, set_attention_metadata
from armserve.layers.lora import set_lora_indices

logger = logging.getLogger("armserve")

# Decode batches up to this size are replayed: up to 8 sequences each size has its graph, beyond
# that sizes share one per multiple of GRAPH_BUCKET (vLLM's CUDA-graph sizes: 1, 2, 4, 8, 16, 24,
# ...), the missing rows padded with a dummy sequence whose key and value go to a spare cache
# block of their own. A graph keeps its activations and logits (Qwen2.5-0.5B at 64: 130 MiB as
# recorded, 56 packed by lifetime), all graphs in one shared arena (capture.Arena: the 15 sizes
# hold 56 MiB, where each with its own tensors held 633);
# past 64 sequences the Python overhead of an eager step (~4-6 ms) is under a tenth of the step.
MAX_GRAPH_BATCH = 64
GRAPH_BUCKET = 8


def graph_batch(n: int) -> int:
    """The graph batch size that serves a decode step of n sequences."""
    return n if n <= GRAPH_BUCKET else -(-n // GRAPH_BUCKET) * GRAPH_BUCKET


class StepGraph:
    """One batch size's decode step (or verifying step of `q` rows per sequence): input buffers,
    the recorded calls and the logits they fill."""

    def __init__(self, batch: int, max_blocks: int, block_size: int, q: int = 1, lora: bool = False) -> None:
        self.batch = batch
        self.q = q
        # LoRA: each row's adapter slot (-1: the base model), an input like the token ids
        self.lora_slots = torch.full((batch,), -1, dtype=torch.long) if lora else None
        self.block_size = block_size
        self.ids = torch.zeros(batch * q, dtype=torch.long)
        self.positions = torch.zeros(batch * q, dtype=torch.long)
        self.slots = torch.zeros(batch * q, dtype=torch.long)
        self.q_start = torch.arange(0, batch * q, q, dtype=torch.int32)
        self.q_len = torch.full((batch,), q, dtype=torch.int32)
        self.context_len = torch.zeros(batch, dtype=torch.int32)
        self.block_tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
        self.attn_batch = kernels.make_attn_batch(self.q_start, self.q_len, self.context_len, self.block_tables,
                                              block_size)
        self._ids, self._positions, self._slots = self.ids.numpy(), self.positions.numpy(), self.slots.numpy()
        self._context_len, self._block_tables = self.context_len.numpy(), self.block_tables.numpy()
        self.recording: capture.Recording | None = None
        self.logits: torch.Tensor | None = None
        self.aux: list[torch.Tensor] | None = None  # EAGLE-3: the target's kept hidden states, rewritten each replay
        self.generation = library.kernel_generation

    def set_inputs(self, ids: list[int], positions: list[int], block_ids: list[list[int]],
                   pad_block: int | None = None, lora_slots: list[int] | None = None) -> None:
        """This step's tokens (one per sequence), their positions and each sequence's blocks; rows
        past them (a bucket's padding) get token 0 at position 0 in `pad_block`."""
        bs = self.block_size
        pad = self.batch - len(ids)
        if pad:
            ids, positions, block_ids = ids + [0] * pad, positions + [0] * pad, block_ids + [[pad_block]] * pad
        # Through numpy views of the buffers: a few microseconds, where a torch.tensor per field
        # cost more than the rest of the step's Python.
        self._ids[:] = ids
        if self.lora_slots is not None:
            self.lora_slots.numpy()[:] = lora_slots + [-1] * pad  # type: ignore[operator]
        self._positions[:] = positions
        self._slots[:] = [b[p // bs] * bs + p % bs for b, p in zip(block_ids, positions)]
        self._context_len[:] = [p + 1 for p in positions]
        for r, (b, p) in enumerate(zip(block_ids, positions)):
            n = p // bs + 1  # blocks holding positions 0..p
            self._block_tables[r, :n] = b[:n]

    def set_verify_inputs(self, tokens: list[list[int]], starts: list[int], block_ids: list[list[int]],
                          pad_block: int) -> None:
        """A verifying step's inputs: per sequence its last known token and drafts (at most q), the
        first one's position and its blocks. Rows past a sequence's tokens (and whole sequences
        past the step's, a bucket's padding) are padding: token 0, writing to `pad_block`."""
        bs, q = self.block_size, self.q
        pad = self.batch - len(tokens)
        tokens, starts, block_ids = tokens + [[]] * pad, starts + [0] * pad, block_ids + [[pad_block]] * pad
        ids, pos, slots = [], [], []
        for t, p0, b in zip(tokens, starts, block_ids):
            ids += t + [0] * (q - len(t))
            # (a padding row's rotary position only shapes its own query and key: p0 keeps it
            # within the rotary table near max_model_len)
            pos += [*range(p0, p0 + len(t)), *[p0] * (q - len(t))]
            slots += [b[p // bs] * bs + p % bs for p in range(p0, p0 + len(t))]
            slots += [pad_block * bs + p % bs for p in range(p0 + len(t), p0 + q)]
        self._ids[:], self._positions[:], self._slots[:] = ids, pos, slots
        self._context_len[:] = [p0 + q for p0 in starts]
        for r, (b, p0) in enumerate(zip(block_ids, starts)):
            n = (p0 + q - 1) // bs + 1
            self._block_tables[r, :n] = (b + [pad_block] * n)[:n]

    def capture(self, model, arena: capture.Arena | None = None) -> torch.Tensor:
        """Run the step eagerly while recording it (its tensors in `arena` when given); returns its
        float32 logits [rows, vocab]."""
        md = AttentionMetadata(slot_mapping=self.slots, num_decodes=self.batch)
        md.kernel_batch = self.attn_batch
        set_attention_metadata(md)
        set_lora_indices(self.lora_slots)
        try:
            with capture.recording(arena) as rec:
                logits = model.compute_logits(model(self.ids, self.positions))
            if getattr(model, "aux_hidden_layers", ()):
                self.aux = list(model.aux_hidden)
        finally:
            set_attention_metadata(None)
            set_lora_indices(None)
        # (a draft model's head may cover part of the vocabulary: engine/draft_proposer.py)
        to_target = getattr(model, "draft_to_target", None)
        width = model.config.vocab_size if to_target is None else to_target.numel()
        if logits.dtype != torch.float32 or tuple(logits.shape) != (self.batch * self.q, width):
            rec.errors.append(f"logits are {logits.dtype} {tuple(logits.shape)}")
        self.recording, self.logits = rec, logits
        return logits

    @property
    def replayable(self) -> bool:
        return self.recording is not None and not self.recording.errors

    def replay(self) -> torch.Tensor:
        """Re-run the recorded step on the current inputs; returns the logits buffer (overwritten
        by the next replay, so consume it first)."""
        capture.run_graph(self.recording)
        return self.logits


class StepGraphs:
    """The model runner's graphs, one per decode batch size, captured on first use."""

    def __init__(self, model, max_blocks: int, block_size: int, enabled: bool, pad_block: int | None = None) -> None:
        self.model = model
        self.pad_block = pad_block  # a cache block no sequence owns, for padding rows (None: exact sizes only)
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.enabled = enabled  # the runner's: kernels on and not enforce_eager
        self.graphs: dict[int, StepGraph] = {}
        self.verify_graphs: dict[tuple[int, int], StepGraph] = {}  # (batch, rows per sequence)
        self.lora_graphs: dict[int, StepGraph] = {}  # steps in which some sequence runs an adapter
        # Shared by every graph's recording (capture.Arena), made after the first replayable one,
        # from its bytes per row; each recording is then packed into its first `arena_used` bytes.
        self.arena: capture.Arena | None = None
        self.arena_used = 0
        self.largest_recording = 0
        self._moved: tuple[StepGraph, list[torch.Tensor]] | None = None  # (`_settle`)
        self.replays = 0  # decode steps served by a replay (tests, stats)
        self.verify_replays = 0
        self.last: StepGraph | None = None  # the graph of the last step served (its `aux`)

    def run(self, ids: list[int], positions: list[int], block_ids: list[list[int]],
            lora_slots: list[int] | None = None) -> torch.Tensor | None:
        """Logits of a decode step, from a graph (replayed, or captured now); None when this step
        must run eagerly (graphs off, batch too large, or the model not capturable). `lora_slots`:
        each sequence's adapter slot (-1: none), None when no sequence has an adapter."""
        n = len(ids)
        b = graph_batch(n) if self.pad_block is not None else n
        if not self.enabled or b > MAX_GRAPH_BATCH:
            return None
        self._settle()
        graphs = self.graphs if lora_slots is None else self.lora_graphs
        g = graphs.get(b)
        if g is not None and g.generation != library.kernel_generation:
            graphs.clear()  # the kernel variant changed since capture: record again
            g = None
        if g is None:
            g = StepGraph(b, self.max_blocks, self.block_size, lora=lora_slots is not None)
            graphs[b] = g
            g.set_inputs(ids, positions, block_ids, self.pad_block, lora_slots)
            logits = g.capture(self.model, self.arena)
            self.last = g
            if not self._check(g) and b != n:
                # computed on padded rows: PyTorch's GEMMs may round a row differently with
                # more rows beside it, so run the step as an eager one would (it rewrites the
                # same cache slots)
                return None
            return logits[:n]  # computed eagerly while recording
        if not g.replayable:
            return None
        g.set_inputs(ids, positions, block_ids, self.pad_block, lora_slots)
        self.replays += 1
        self.last = g
        return g.replay()[:n]

    def run_verify(self, tokens: list[list[int]], starts: list[int],
                   block_ids: list[list[int]]) -> tuple[torch.Tensor, int] | None:
        """Logits of a verifying step (per sequence: its last known token and its drafts, the
        first one's position, its blocks) from a graph, and the graph's rows per sequence q (the
        logits of sequence i's row j are row i * q + j); None when the step must run eagerly."""
        q = max(map(len, tokens))
        b = graph_batch(len(tokens))
        if (not self.enabled or self.pad_block is None or b * q > MAX_GRAPH_BATCH
                or (max(starts) + q - 1) // self.block_size >= self.max_blocks):
            return None  # (the last: padding rows past the block tables' width, at max_model_len)
        self._settle()
        g = self.verify_graphs.get((b, q))
        if g is not None and g.generation != library.kernel_generation:
            self.verify_graphs.clear()
            g = None
        if g is None:
            g = self.verify_graphs[(b, q)] = StepGraph(b, self.max_blocks, self.block_size, q)
            g.set_verify_inputs(tokens, starts, block_ids, self.pad_block)
            logits = g.capture(self.model, self.arena)
            self.last = g
            # (not replayable: something fell back to PyTorch, which may round the real rows
            # differently beside padding ones; the eager step rewrites the same slots)
            return (logits, q) if self._check(g) else None
        if not g.replayable:
            return None
        g.set_verify_inputs(tokens, starts, block_ids, self.pad_block)
        self.verify_replays += 1
        self.last = g
        return g.replay(), q

    def _check(self, g: StepGraph) -> bool:
        """Whether the just recorded `g` can be replayed; if not, it keeps nothing. The first that
        can sizes the arena the later ones share: its bytes per row, for MAX_GRAPH_BATCH rows and a
        quarter more (untouched pages cost nothing)."""
        rec = g.recording
        if rec is not None and rec.arena is not None and rec.arena.spilled:
            logger.debug("the step graph of %d x %d rows put %d bytes beside the shared arena", g.batch, g.q,
                         rec.arena.spilled)
        if g.replayable and self.arena is None:
            kept = sum(nbytes for _, nbytes in rec.regions)  # type: ignore[union-attr]
            self.arena = capture.Arena(kept // (g.batch * g.q) * MAX_GRAPH_BATCH * 5 // 4)
        if g.replayable:
            self._pack(g)
        if not g.replayable:
            # e.g. a float16 model's matmuls beyond the skinny kernel's token limit go to
            # PyTorch (bfloat16 ones run the dense GEMM at any size): that shape stays eager
            logger.info("steps of %d sequences x %d rows run eagerly: the step cannot be replayed (%s)", g.batch,
                        g.q, ", ".join(sorted(set(g.recording.errors))[:5]))  # type: ignore[union-attr]
            g.recording.keep.clear()  # type: ignore[union-attr]
            g.logits = None
            return False
        return True

    def _pack(self, g: StepGraph) -> None:
        """Lay `g`'s tensors out by lifetime in the arena (capture.Recording.pack): its later replays
        compute there; this step's outputs stay where the recording computed them until `_settle`."""
        rec, arena = g.recording, self.arena
        # (bytes the recording allocated, laid end to end: what the graph held before packing)
        self.largest_recording = max(self.largest_recording, sum(n for _, n in rec.regions))  # type: ignore[union-attr]
        held = [g.logits, *(g.aux or [])]
        packed = rec.pack(arena, held)  # type: ignore[union-attr, arg-type]
        if packed is None:  # (stays as recorded, in the arena's first `top` bytes or beside it)
            self.arena_used = max(self.arena_used, arena.top)  # type: ignore[union-attr]
            return
        used, moved = packed
        self.arena_used = max(self.arena_used, used)
        # (this step reads the logits and kept hidden states where the recording computed them)
        self._moved = (g, moved)

    def release_scratch(self) -> None:
        """Hand the arena's pages back to the system between steps (an idle engine: IdleTrim):
        every replay recomputes what it holds from the graph's input buffers, and the last step's
        outputs have been read. The next step faults in the pages it touches, zeroed (Qwen2.5-0.5B
        at 64 sequences: 55 MiB, ~10 ms once)."""
        if self.arena is not None:
            self.arena.release_beyond(0)

    def _settle(self) -> None:
        """Before a step: the graph packed last step reads its outputs at their new places now,
        and the arena's pages past what the graphs use go back."""
        if self._moved is not None:
            (g, moved), self._moved = self._moved, None
            g.logits = moved[0]
            if g.aux is not None:
                g.aux = moved[1:]
            self.arena.release_beyond(self.arena_used)  # type: ignore[union-attr]
