"""Write one benchmark's section of docs/benchmarks.md, leaving the other sections alone."""

from __future__ import annotations

import os
import platform
import subprocess

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md")
HEADER = "# armserve benchmarks\n\nEvery figure is measured on the machine described in its section, in one run beside its peers.\n"


def machine_description() -> str:
    """One line: CPU model, cores, memory, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu model")):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.machine()}, torch {torch.__version__}"


def load_average() -> float:
    return os.getloadavg()[0]


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(DOC)).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def update_section(name: str, body: str, path: str = DOC) -> None:
    """Replace the text between `<!-- BEGIN name -->` and `<!-- END name -->` (or append it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = open(path).read() if os.path.exists(path) else HEADER
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        a = text.index(begin)
        b = text.index(end) + len(end)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)
