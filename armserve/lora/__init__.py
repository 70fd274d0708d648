"""LoRA adapters over one base model (PEFT folders, llama.cpp GGUF LoRA files), many in one batch.

    request.py        LoRARequest: which adapter a request runs with (vLLM's fields); LoRAError
    adapter.py        an adapter read and checked against the base model (a PEFT folder)
    gguf_adapter.py   a llama.cpp GGUF LoRA file's tensors, in Hugging Face order
    manager.py        adapters cached on the CPU (LRU) and the slots one batch draws from

The layers' side (stacked per-slot weights, the step's per-token slot) is layers/lora.py; the
grouped shrink/expand ops are kernels/lora.py.
"""

# (torch-free: the server's front end imports this package; adapter.py and manager.py run in the engine)
from armserve.lora.request import LoRAError, LoRARequest  # noqa: F401
