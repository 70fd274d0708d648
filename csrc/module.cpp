// Makes the kernel library an importable extension module, so pip builds and tags it as a
// platform wheel. Python reaches the kernels through ctypes (armserve/kernels/), not this module.
#include <Python.h>

static struct PyModuleDef armserve_c_module = {PyModuleDef_HEAD_INIT, "_C", "armserve CPU kernels (C ABI)", -1,
                                               nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&armserve_c_module); }
