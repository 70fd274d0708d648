"""Builds armserve's C++ kernels into armserve/_C*.so during `pip install`.

Each ISA variant is compiled with its own flags (csrc/build.py); no torch is needed to build.
A machine without a C++ compiler still installs armserve: it then runs on the PyTorch path and
says so with a warning at start-up.
"""

import os
import platform
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))
import build as kernel_build  # noqa: E402


class BuildKernels(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cxx = os.environ.get("CXX", "g++")
        arch = kernel_build.normalize_arch(platform.machine())
        module = (os.path.join(kernel_build.HERE, "module.cpp"), ["-I", sysconfig.get_paths()["include"]])
        try:
            # Objects go to build_temp, so they never end up inside the wheel.
            kernel_build.build(cxx, arch, out, extra_sources=[module],
                               build_dir=os.path.join(self.build_temp, "armserve-kernels"))
        except Exception as e:  # no compiler, unsupported toolchain, ...
            self.warn(f"armserve: C++ kernels not built ({e}); armserve will use its PyTorch path")


# ARMSERVE_BUILD_KERNELS=0: the Python files only; scripts/build_wheels.sh compiles the kernels itself
# (every variant of each architecture, cross-compiled for aarch64) and adds them to this wheel.
kernels = [] if os.environ.get("ARMSERVE_BUILD_KERNELS") == "0" else [Extension("armserve._C", sources=[])]
setup(ext_modules=kernels, cmdclass={"build_ext": BuildKernels})
