"""Quantized weights: their formats, where they come from and the layer that runs them.

    formats.py     QuantizedTensor (w4 / w8), rounding float weights to it, the kernels' packed layout
    gguf.py        GGUF blocks (Q4_0, Q4_1, Q4_K, Q5_0, Q8_0, Q6_K) -> QuantizedTensor, bit-exactly
    checkpoint.py  the tensors `armserve quantize` writes and the loader reads back
    quantize.py    the `armserve quantize` command (import it from there: it reads the model
                   through model_loader, which imports this package)
    linear.py      QuantizedLinear: int8 activations times int4 / int8 weights on the qgemm kernels
    embedding.py   QuantizedEmbedding: a token table kept quantized, rows dequantized per lookup

The kernels' PyTorch references (quantize_act_ref, qlinear_ref, qgemm_dense_ref) are in
armserve/kernels/reference.py.
"""

from armserve.quantization.formats import (  # noqa: F401
    QuantizedTensor, kernel_scales, pack, quantize_weight, quantize_weight_int8,
)
from armserve.quantization.linear import QuantizedLinear  # noqa: F401
