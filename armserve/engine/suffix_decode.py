"""Suffix decoding (`speculative_config` method "suffix", vLLM's; Oliaro et al. 2024,
arXiv:2411.04975): drafts from frequency-counted suffix trees instead of a model.

Two kinds of tree, each holding every suffix of its sequences cut to `max_tree_depth` tokens:

    local   one per request: its prompt and its output so far
    global  one per engine: the outputs of the last `max_cached_requests` requests (the oldest
            evicted first), so an agent loop or a batch of similar requests drafts from what
            earlier requests wrote

Each step the request's last tokens are matched in both trees, for every match length m that
occurs; from the end of a match the draft follows the most frequent continuation, token by
token, while the estimated probability (the product of count(child) / count(node) along the
way) stays >= `min_token_prob`, and for at most `max_spec_factor` x m tokens (a longer match earns
a longer draft). The draft with the largest sum of probabilities wins (the longer match on a tie).

The tree is path-compressed (an edge stands for a run of tokens of one sequence, `seq[start:
start + length]`) and built online: each sequence keeps its `max_tree_depth` growing suffixes
("active" nodes, each ending exactly at a node), and appending a token moves each of them one
token down, so an append costs O(depth) and the tree has at most two nodes per suffix. A node's
count is the number of suffixes that pass through or end at it. Arctic Inference (Snowflake's
implementation, which vLLM imports) needs torch 2.7 to build, hence this one.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from armserve.config import SpeculativeConfig
from armserve.engine.request import Request
from armserve.engine.spec_decode import SpecState, draft_limit, request_state


class _Node:
    # edge tokens: seq[start:start + length]; `seq` is a sequence's token list (or, after the
    # sequence was removed, a copy of the edge), `children` None for a leaf
    __slots__ = ("parent", "children", "count", "seq", "start", "length")

    def __init__(self, parent: "_Node | None", seq: list[int], start: int, length: int, count: int) -> None:
        self.parent = parent
        self.children: dict[int, _Node] | None = None
        self.count = count
        self.seq = seq
        self.start = start
        self.length = length

    def first(self) -> int:
        return self.seq[self.start]


class SuffixTree:
    """Depth-limited, path-compressed suffix tree over several sequences, with suffix counts."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(None, [], 0, 0, 0)
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, deque[_Node]] = {}

    def __len__(self) -> int:
        """Tokens held (over all sequences)."""
        return sum(map(len, self._seqs.values()))

    def num_nodes(self) -> int:
        n, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            n += 1
            if node.children:
                stack.extend(node.children.values())
        return n

    def extend(self, sid: int, tokens: list[int]) -> None:
        for t in tokens:
            self.append(sid, t)

    def append(self, sid: int, token: int) -> None:
        """Append `token` to sequence `sid` (made on first use): every suffix of it that is still
        shorter than max_depth grows by the token, and a new one starts."""
        seq = self._seqs.get(sid)
        if seq is None:
            seq = self._seqs[sid] = []
            self._active[sid] = deque()
        active = self._active[sid]
        root = self.root
        root.count += 1
        active.append(root)  # the empty suffix that starts at the new token
        if len(active) > self.max_depth:
            active.popleft()  # that suffix has max_depth tokens: it stays where it is
        seq.append(token)
        n = len(seq)
        for i, node in enumerate(active):
            children = node.children
            child = children.get(token) if children else None
            if child is None:
                if node.count == 1 and node is not root:
                    # a leaf only this suffix reaches: it grows
                    node.length += 1
                    node.seq, node.start = seq, n - node.length
                else:
                    leaf = _Node(node, seq, n - 1, 1, 1)
                    if children is None:
                        node.children = children = {}
                    children[token] = leaf
                    active[i] = leaf
            elif node.count == child.count + 1 and node is not root:
                # only this suffix ends at `node`, every other one goes on into `child`: the
                # boundary between them moves one token down
                if child.length == 1:  # `node` and `child` become one node
                    parent = node.parent
                    parent.children[node.first()] = child  # type: ignore[union-attr]
                    child.parent = parent
                    child.count += 1
                    child.length = node.length + 1
                    child.seq, child.start = seq, n - child.length
                    active[i] = child
                else:
                    node.length += 1
                    node.seq, node.start = seq, n - node.length
                    del children[token]  # type: ignore[union-attr]
                    child.start += 1
                    child.length -= 1
                    children[child.first()] = child  # type: ignore[index]
            elif child.length == 1:
                child.count += 1
                child.seq, child.start = seq, n - 1
                active[i] = child
            else:  # the suffix ends inside `child`'s edge: split it after one token
                mid = _Node(node, seq, n - 1, 1, child.count + 1)
                child.start += 1
                child.length -= 1
                child.parent = mid
                mid.children = {child.first(): child}
                children[token] = mid  # type: ignore[index]
                active[i] = mid

    def remove(self, sid: int) -> None:
        """Take sequence `sid`'s suffixes out of the tree (nodes only it reached are freed)."""
        seq = self._seqs.pop(sid)
        del self._active[sid]
        root, depth, n = self.root, self.max_depth, len(seq)
        for start in range(n):
            end = min(n, start + depth)
            node, idx = root, start
            node.count -= 1
            while idx < end:
                child = node.children[seq[idx]]  # type: ignore[index]
                child.count -= 1
                if child.count == 0:
                    del node.children[seq[idx]]  # type: ignore[union-attr]
                    if not node.children:
                        node.children = None
                    break
                if child.seq is seq:  # keep its tokens once `seq` is gone
                    child.seq = seq[child.start:child.start + child.length]
                    child.start = 0
                idx += child.length
                node = child
            # no suffix ends at `node` any more and it has one child: they become one node
            if node is not root and node.children and len(node.children) == 1:
                (only,) = node.children.values()
                if only.count == node.count:
                    parent = node.parent
                    only.seq = node.seq[node.start:node.start + node.length] + only.seq[
                        only.start:only.start + only.length]
                    only.start, only.length = 0, len(only.seq)
                    only.parent = parent
                    parent.children[only.seq[0]] = only  # type: ignore[union-attr]

    def _match(self, pattern: list[int]) -> tuple[_Node | None, int]:
        """Where `pattern` ends in the tree: (node, tokens of its edge matched), or (None, 0)."""
        node, idx = self.root, 0
        for t in pattern:
            if idx == node.length:
                node = node.children.get(t) if node.children else None  # type: ignore[assignment]
                if node is None:
                    return None, 0
                idx = 0
            if node.seq[node.start + idx] != t:
                return None, 0
            idx += 1
        return node, idx

    def speculate(self, pattern: list[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float, int]:
        """The best draft after `pattern`: (tokens, score = sum of their probabilities, match
        length); ([], 0.0, 0) when no suffix of it occurs."""
        best: tuple[list[int], float, int] = ([], 0.0, 0)
        for m in range(1, len(pattern)):
            if self.max_depth - m < best[1]:
                break  # (a path holds max_depth tokens: a longer match drafts too few to win)
            node, idx = self._match(pattern[len(pattern) - m:])
            if node is None:
                break  # a longer suffix cannot occur either
            cap = min(max_tokens, int(m * max_spec_factor + 1e-6))
            if cap < best[1]:
                continue  # (a score is a sum of at most `cap` probabilities: it cannot win)
            toks, score = _follow(node, idx, cap, min_token_prob)
            if score >= best[1]:
                best = (toks, score, m)
        return best


def _follow(node: _Node, idx: int, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent path down from inside `node`'s edge (ties: the smaller token id)."""
    toks: list[int] = []
    prob, score = 1.0, 0.0
    while len(toks) < max_tokens:
        if idx < node.length:
            toks.append(node.seq[node.start + idx])
            score += prob
            idx += 1
            continue
        if not node.children:
            break
        child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))[1]
        prob *= child.count / node.count
        if prob < min_prob:
            break
        node, idx = child, 0
    return toks, score


class _SuffixState:
    """A request's local tree and how much of its sequence the trees have seen."""

    __slots__ = ("tree", "indexed", "gid")

    def __init__(self, depth: int) -> None:
        self.tree = SuffixTree(depth)
        self.indexed = 0  # tokens of all_token_ids added to the trees
        self.gid: int | None = None  # its output's sequence id in the global tree


class SuffixProposer:
    """Suffix-decoding drafts (`speculative_config` method "suffix")."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.depth: int = config.suffix_decoding_max_tree_depth  # type: ignore[assignment]
        self.max_cached: int = config.suffix_decoding_max_cached_requests  # type: ignore[assignment]
        self.factor: float = config.suffix_decoding_max_spec_factor  # type: ignore[assignment]
        self.min_prob: float = config.suffix_decoding_min_token_prob  # type: ignore[assignment]
        self.step = 0
        # the longest draft the trees can make: a match of m tokens drafts at most factor x m and
        # the depth less m
        self.max_draft = min(self.k, max((min(int(m * self.factor + 1e-6), self.depth - m)
                                          for m in range(1, self.depth)), default=0))
        self.global_tree = SuffixTree(self.depth)
        self.cached: OrderedDict[int, None] = OrderedDict()  # global sequence ids, oldest first
        self._next_gid = 0

    def state(self, req: Request) -> SpecState | None:
        st = request_state(req, 1, 0, self.k)
        if st is not None and st.suffix is None:
            st.suffix = _SuffixState(self.depth)
        return st

    def _sync(self, req: Request, sx: _SuffixState) -> None:
        """Add the request's tokens the trees have not seen: the prompt to its own tree, the
        output to its own and (while cached) the global one."""
        toks, prompt_len = req.all_token_ids, len(req.prompt_token_ids)
        if sx.indexed == 0 and self.max_cached > 0:
            sx.gid = self._next_gid
            self._next_gid += 1
            self.cached[sx.gid] = None
            while len(self.cached) > self.max_cached:
                gid, _ = self.cached.popitem(last=False)
                self.global_tree.remove(gid)
        for p in range(sx.indexed, len(toks)):
            sx.tree.append(0, toks[p])
            if p >= prompt_len and sx.gid in self.cached:
                self.global_tree.append(sx.gid, toks[p])  # type: ignore[arg-type]
        sx.indexed = len(toks)

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(limit, the request's k) tokens: the better of the local and global trees'
        drafts after the request's last max_tree_depth tokens; [] when neither matches."""
        st = self.state(req)
        k = draft_limit(st, self.step, limit)
        sx = st.suffix if st is not None else None
        if sx is None:
            return []
        self._sync(req, sx)
        if k == 0:
            return []
        pattern = req.all_token_ids[-self.depth:]
        toks, score, _ = sx.tree.speculate(pattern, k, self.factor, self.min_prob)
        if self.max_cached > 0:
            gtoks, gscore, _ = self.global_tree.speculate(pattern, k, self.factor, self.min_prob)
            if gscore > score:
                toks = gtoks
        return toks

    def finish(self, req: Request) -> None:
        """A request ended: its whole output goes to the global tree, its own tree is dropped."""
        st = req.spec
        if st and st.suffix is not None:
            self._sync(req, st.suffix)
            st.suffix = None
