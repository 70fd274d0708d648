"""A grammar-compile worker process (run as a script by structured_output.GrammarCompilePool):
compiles one structured-output constraint at a time with xgrammar and sends back the compiled
grammar serialized as JSON. It is a separate process so that a grammar too complex to compile
(xgrammar has no cancellation) can be killed: past its time budget, when its request is
aborted, or when it reaches its memory limit (RLIMIT_AS).

Protocol (multiprocessing.connection framing and pickle, over two pipes given as argv fds):
    parent -> worker   ("init", tokenizer_info, memory_limit_bytes, cache_limit_bytes)   once
                       (tokenizer_info: xgrammar's TokenizerInfo JSON, UTF-8, zlib-compressed)
                       (job_id, kind, spec, any_whitespace)                 per compile
    worker -> parent   ("ready", pid)
                       (job_id, "ok", compiled_json)
                       (job_id, "invalid", message)       the constraint is invalid
                       (job_id, "memory", message)        the memory limit was reached (then it exits)

Standalone on purpose: it imports neither armserve nor anything of the engine (only xgrammar),
and no __main__ module is re-imported as multiprocessing's spawn would.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import zlib

# Run as a script, its folder (armserve/engine: core.py, request.py, ...) leads sys.path and
# would shadow libraries' modules of the same names.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def _die_with_parent() -> None:
    """Be killed when the process (thread) that started us goes: Linux's PR_SET_PDEATHSIG,
    and elsewhere a thread that notices the re-parenting."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    # (also covers the race of a parent that died before prctl ran)
    threading.Thread(target=watch, daemon=True).start()


def _vm_size_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _limit_memory(extra: int) -> None:
    """Cap the address space at what the worker maps now plus `extra` bytes: a compile past it
    fails to allocate (xgrammar raises, or the process aborts)."""
    if extra <= 0:
        return
    try:
        import resource

        base = _vm_size_bytes()
        if base:
            resource.setrlimit(resource.RLIMIT_AS, (base + extra, base + extra))
    except (ImportError, ValueError, OSError):
        pass


# Modules xgrammar's compiler and tokenizer info import that a worker never uses: torch (its
# matcher's kernels), the tokenizer libraries (TokenizerInfo.from_huggingface and friends; a worker
# gets the table as JSON). Blocked (None: `import` raises ImportError, which xgrammar and tvm_ffi
# catch for the optional ones) or, for transformers, which tokenizer_info imports two base classes
# from for its type checks, a stand-in with those two names. Without them a worker holds ~25 MiB
# less (transformers pulls in huggingface_hub, httpx, trio, PIL).
_BLOCKED = ("torch", "sentencepiece", "tiktoken")


def _stand_ins() -> dict:
    import types

    transformers = types.ModuleType("transformers")
    transformers.__doc__ = "armserve grammar worker: a stand-in (xgrammar's type checks only)"
    transformers.PreTrainedTokenizerBase = type("PreTrainedTokenizerBase", (), {})
    transformers.PreTrainedTokenizerFast = type("PreTrainedTokenizerFast", (transformers.PreTrainedTokenizerBase,), {})
    return {"transformers": transformers, **{name: None for name in _BLOCKED}}


def _import_xgrammar():
    """xgrammar's compiler and tokenizer info without its matcher, kernels and testing modules,
    which import torch, and without the tokenizer libraries (`_BLOCKED`): the worker then starts
    in ~0.5 s with ~30 MB of its own memory instead of ~1.5 s and ~200 MB. Falls back to the
    whole package if its layout changed."""
    import importlib
    import importlib.util
    import types

    stand_ins = {name: mod for name, mod in _stand_ins().items() if name not in sys.modules}
    try:
        sys.modules.update(stand_ins)
        spec = importlib.util.find_spec("xgrammar")
        pkg = types.ModuleType("xgrammar")
        pkg.__path__ = list(spec.submodule_search_locations)  # type: ignore[union-attr, arg-type]
        pkg.__spec__ = spec
        sys.modules["xgrammar"] = pkg
        importlib.import_module("xgrammar.load_binding")
        importlib.import_module("xgrammar.exception")
        compiler = importlib.import_module("xgrammar.compiler")
        tokenizer_info = importlib.import_module("xgrammar.tokenizer_info")
        return compiler.GrammarCompiler, tokenizer_info.TokenizerInfo
    except Exception:
        for name in [n for n in sys.modules if n == "xgrammar" or n.startswith("xgrammar.")]:
            del sys.modules[name]
        for name, mod in stand_ins.items():
            if sys.modules.get(name, 0) is mod:
                del sys.modules[name]
        import xgrammar as xgr

        return xgr.GrammarCompiler, xgr.TokenizerInfo


def _release_free_heap() -> None:
    """glibc's malloc_trim: the tokenizer table's JSON parse and a compile's transients leave ~45 MB
    of freed heap resident otherwise (armserve.memory.release_free_heap; not imported: this
    script imports nothing of armserve)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _compile(compiler, kind: str, spec: str, any_whitespace: bool):
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=any_whitespace,
                                            separators=None if any_whitespace else (", ", ": "))
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_grammar(spec)  # "grammar", and "choice" as its EBNF


def main(read_fd: int, write_fd: int) -> None:
    _die_with_parent()
    from multiprocessing.connection import Connection

    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        _, info_z, memory_limit, cache_limit = inbox.recv()
    except EOFError:
        return
    GrammarCompiler, TokenizerInfo = _import_xgrammar()
    info_json = zlib.decompress(info_z).decode()
    del info_z
    info = TokenizerInfo.deserialize_json(info_json)
    # xgrammar's own cache, bounded: it keeps the masks of sub-grammars too, so a schema sharing
    # parts with one compiled before (a string with maxLength, ...) compiles in ~1 ms, not ~80.
    # One thread: one core per compile.
    compiler = GrammarCompiler(info, max_threads=1, cache_enabled=cache_limit > 0, cache_limit_bytes=cache_limit)
    del info_json
    _release_free_heap()
    _limit_memory(memory_limit)
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            job_id, kind, spec, any_whitespace = inbox.recv()
        except EOFError:  # the pool closed
            return
        try:
            compiled = _compile(compiler, kind, spec, any_whitespace)
            reply = (job_id, "ok", compiled.serialize_json())
            del compiled
        except MemoryError as e:
            outbox.send((job_id, "memory", str(e)))
            return  # the heap may be in any state: the pool starts a fresh worker
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / TypeError for invalid input
            if "bad_alloc" in str(e) or "std::bad_alloc" in type(e).__name__:
                outbox.send((job_id, "memory", str(e)))
                return
            reply = (job_id, "invalid", str(e))
        outbox.send(reply)
        del reply
        _release_free_heap()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
