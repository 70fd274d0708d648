"""The install commands the README (and the backends' error messages) give, run in a fresh
virtualenv: torch 2.13.0, then armserve from a copy of this tree (`pip install .`, C++ kernels
built), the `openvino` extra, the OpenVINO exporter's environment
(`python -m armserve.engine.openvino_backend --install-exporter`) and xgrammar without triton.
Afterwards transformers and armserve import next to the CPU torch, nothing pulled torchvision,
triton or another torch, `pip check` reports only xgrammar's triton, and the exporter's
environment sees this virtualenv's packages (not the base interpreter's) with a transformers
optimum-intel supports. Every extra armserve declares is resolved too (pip --dry-run), so none
can drag a CUDA torch, torchvision or triton back in.

One test, ~2 minutes (pip's downloads and the kernels' build, on 2 cores); it needs the package
index, as scripts/setup.sh does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Packages that, installed next to the CPU torch 2.13.0 from its wheel, mean a CUDA or mismatched
# build came in (torchvision's wheel is built against another torch: `import transformers` then
# fails with "operator torchvision::nms does not exist").
FORBIDDEN = {"torch", "torchvision", "torchaudio", "triton"}
# The one requirement left unmet on purpose: xgrammar's wheel declares triton (GPU kernels) on
# x86 Linux; it is installed with --no-deps (README, scripts/setup.sh).
KNOWN_PIP_CHECK = ("xgrammar ", " requires triton,")


def start(cmd: list[str], cwd: str) -> subprocess.Popen:
    """Start `cmd` in `cwd` (never this tree: `python -c` would import its armserve and read its
    egg-info); `finish` waits for it."""
    # PIP_COMPILE=0: no byte-compiling of every installed module (torch's alone are thousands);
    # what the checks import compiles on import. It changes nothing of what gets installed.
    env = dict(os.environ, PIP_ROOT_USER_ACTION="ignore", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_COMPILE="0")
    env.pop("PYTHONPATH", None)
    # The objects scripts/setup.sh compiled for this tree (its default cache; .ci/run's too): `pip
    # install .` links them. The compiler's own run is setup.sh's, not this test's.
    env.setdefault("ARMSERVE_BUILD_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "armserve-build"))
    env.pop("ARMSERVE_OPENVINO_EXPORT_PYTHON", None)
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(p: subprocess.Popen, timeout: float = 900) -> str:
    """The output of a started command; a failure shows the command and its output."""
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode == 0, f"{' '.join(p.args)} failed ({p.returncode}):\n{out[-6000:]}"
    return out


def run(cmd: list[str], cwd: str) -> str:
    """Run `cmd` in `cwd`, its output returned."""
    return finish(start(cmd, cwd))


def copy_tree(dst: str) -> None:
    """The project's files as git sees them (tracked, and new ones not ignored), without build
    products: `pip install .` builds in the source folder, which must not be the shared tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             check=True, stdout=subprocess.PIPE).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = None
    if not files:
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "*.so",
                                                                 "__pycache__", "results"))
        return
    for f in files:
        src = os.path.join(REPO, f)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, f))


def installed(python: str, cwd: str) -> dict[str, str]:
    out = run([python, "-m", "pip", "list", "--format", "json"], cwd)
    return {d["name"].lower(): d["version"] for d in json.loads(out)}


def test_readme_install_commands_leave_a_working_virtualenv(tmp_path):
    tmp = str(tmp_path)
    venv = str(tmp_path / "venv")
    src = str(tmp_path / "src")
    copy_tree(src)
    run([sys.executable, "-m", "venv", venv], tmp)
    py = os.path.join(venv, "bin", "python")
    # (--no-compile: byte-compiling every installed module, torch's thousands among them, is ~10 s of
    # CPU per torch alone and checks nothing here; what the test imports compiles on import)
    pip = [py, "-m", "pip", "install", "-q", "--no-compile"]

    # The README's order: torch first, then armserve from this folder.
    run([*pip, "torch==2.13.0"], tmp)
    run([*pip, src], tmp)
    run([*pip, "armserve[openvino]"], tmp)
    # ... which are the commands the backend's error message names; where the exporter's environment
    # will be; armserve's extras. (One interpreter for the three: each import of armserve is seconds.)
    out = run([py, "-c", textwrap.dedent("""
        import importlib.metadata as m, json
        from armserve.engine.openvino_backend import INSTALL_HINT, export_env_dir
        print(json.dumps([INSTALL_HINT, export_env_dir(), m.metadata('armserve').get_all('Provides-Extra') or []]))
        """)], tmp)
    hint, exporter_env, extras = json.loads(out.strip().splitlines()[-1])
    extras = ",".join(extras)
    assert f"{py} -m pip install armserve[openvino]" in hint, hint
    assert f"{py} -m armserve.engine.openvino_backend --install-exporter" in hint, hint
    before_exporter = installed(py, tmp)
    assert exporter_env.startswith(os.path.join(os.path.expanduser("~"), ".cache", "armserve"))
    # Every declared extra resolved (checked at the end) while the exporter installs: a dry run
    # touches no environment, and the exporter's is not this one (checked below).
    report = str(tmp_path / "report.json")
    dry_run = start([*pip, "--dry-run", "--report", report, f"armserve[{extras}]"], tmp)
    try:
        out = run([py, "-m", "armserve.engine.openvino_backend", "--install-exporter"], tmp)
        assert "the OpenVINO exporter is ready" in out, out
        # The exporter's environment is its own: this virtualenv is exactly as it was.
        assert installed(py, tmp) == before_exporter
        run([*pip, "--no-deps", "xgrammar>=0.2.8,<0.3", "apache-tvm-ffi>=0.1.11"], tmp)

        pkgs = installed(py, tmp)
        assert pkgs["torch"] == "2.13.0+cpu"
        assert not (FORBIDDEN - {"torch"}) & set(pkgs), sorted(FORBIDDEN & set(pkgs))
        assert not [n for n in pkgs if n.startswith("nvidia-")]
        # The failure reported: transformers (and so armserve) would not even import.
        # (export_python() is the exporter's environment's python, checked below.)
        out = run([py, "-c", textwrap.dedent("""
            import json
            from transformers import LlamaConfig
            import armserve, openvino_genai, torch, transformers, xgrammar
            from armserve import kernels
            from armserve.engine.openvino_backend import export_python
            assert kernels.available(), kernels.load_error()
            xgrammar.Grammar.from_regex("[0-9]+")
            print(json.dumps([transformers.__version__, export_python()]))
            """)], tmp)
        serving_transformers, exporter = json.loads(out.strip().splitlines()[-1])

        check = subprocess.run([py, "-m", "pip", "check"], cwd=tmp, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True).stdout.strip().splitlines()
        unexpected = [line for line in check if not (line.startswith(KNOWN_PIP_CHECK[0]) and KNOWN_PIP_CHECK[1] in line)
                      and not line.startswith("No broken requirements")]
        assert not unexpected, check

        # The exporter: found by export_python() for this environment, sees this virtualenv's torch
        # and openvino, and has a transformers optimum-intel supports, while serving keeps its own.
        assert exporter == os.path.join(exporter_env, "bin", "python")
        out = run([exporter, "-c", textwrap.dedent("""
            import json, openvino, torch, transformers
            import optimum.intel
            from optimum.exporters.openvino import main_export
            print(json.dumps([torch.__file__, openvino.__file__, transformers.__version__]))
            """)], tmp)
        torch_file, ov_file, export_transformers = json.loads(out.strip().splitlines()[-1])
        assert torch_file.startswith(venv + os.sep) and ov_file.startswith(venv + os.sep), (torch_file, ov_file)
        assert tuple(int(x) for x in export_transformers.split(".")[:2]) < (5, 6)
        assert run([py, "-c", "import transformers; print(transformers.__version__)"], tmp).strip() == serving_transformers

        # Every declared extra resolves without a CUDA torch, torchvision or triton.
        assert "openvino" in extras.split(",") and "structured" not in extras.split(","), extras
        finish(dry_run)
        with open(report) as f:
            would = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(f)["install"]}
        assert not FORBIDDEN & set(would), {n: would[n] for n in FORBIDDEN & set(would)}
        assert not [n for n in would if n.startswith("nvidia-")]
    finally:
        if dry_run.poll() is None:
            dry_run.kill()
        shutil.rmtree(exporter_env, ignore_errors=True)
