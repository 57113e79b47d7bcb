"""Names of tensors in the checkpoints exo reads and writes: a fact of the file format that
the GGUF converter (`download/gguf_repack.py`), the engine's loader and placement share."""

from __future__ import annotations

import re

# A decoder layer's tensors in a transformers checkpoint: `model.layers.<index>.<rest>`.
LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Suffixes of the stored tensors of one int4 weight repacked from GGUF blocks
# (`download/gguf_repack.py`'s module docstring describes the layout).
INT4_PACKED = ".int4_packed"
INT4_SCALES = ".int4_scales"
INT4_ZEROS = ".int4_zeros"
# A Q4_K weight's compact scales, in place of `INT4_SCALES` / `INT4_ZEROS`
# (`worker/engines/torch/quant/q4k_scales.py`).
INT4_Q4K_SCALES = ".int4_q4k_scales"
