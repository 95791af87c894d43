"""flashattn: exact attention the FlashAttention way, on the CPU.

Upstream FlashAttention's Python functions, with the same names, arguments, defaults,
layouts ((batch, seqlen, heads, head_dim)) and return conventions, on NumPy arrays
(float32, float16, ml_dtypes.bfloat16) and PyTorch CPU tensors. Inputs are passed to the
C++ library without copies; the GIL is released while it computes.

Dropout: the mask is a pure function of (seed, offset, batch, head, row, column). Without
``seed=``, tensors draw (seed, offset) from torch's default CPU generator (torch.manual_seed
reproduces a run, torch.utils.checkpoint recomputes the same mask) and NumPy arrays draw
the seed from numpy.random's global state; NumPy users pass the forward's seed to
``flash_attn_backward``. Tensor calls are the torch.library ops ``torch.ops.flashattn.*``,
which torch.compile and torch.export see whole.

Threads: ``num_threads=`` on every function, else ``set_num_threads()``'s value, else
``torch.get_num_threads()`` for tensors and the OpenMP default for NumPy arrays.
"""

import pkgutil as _pkgutil

# The native module may live in a build tree beside these sources (development) or in
# this directory (installed wheel).
__path__ = _pkgutil.extend_path(__path__, __name__)

from ._C import __version__  # noqa: E402  (CMakeLists.txt's project() version)
from ._interface import (  # noqa: E402
    flash_attn_backward,
    flash_attn_combine,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_backward,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    get_num_threads,
    hadamard_dim,
    hadamard_rotate,
    last_num_threads,
    plan,
    set_num_threads,
    simd_target,
)
from ._flex import BlockMask, create_block_mask, flex_attention  # noqa: E402
from ._sdpa import scaled_dot_product_attention  # noqa: E402



def install_as_flash_attn() -> bool:
    """Opt-in: lets unchanged code that imports ``flash_attn`` (``from flash_attn import
    flash_attn_func``, ``flash_attn.flash_attn_interface``) run on flashattn, by registering
    flashattn under those names in sys.modules — only where no real ``flash_attn`` can be
    imported, so an installed FlashAttention is never shadowed. Returns whether the names
    now refer to flashattn. Needs PyTorch (upstream's module is a PyTorch one)."""
    import importlib.util
    import sys

    from . import flash_attn_interface

    current = sys.modules.get("flash_attn")
    if current is not None:
        return current is sys.modules[__name__]
    if importlib.util.find_spec("flash_attn") is not None:
        return False
    sys.modules["flash_attn"] = sys.modules[__name__]
    sys.modules["flash_attn.flash_attn_interface"] = flash_attn_interface
    return True


__all__ = [
    "__version__",
    "BlockMask",
    "create_block_mask",
    "flex_attention",
    "install_as_flash_attn",
    "flash_attn_backward",
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_backward",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "get_num_threads",
    "hadamard_dim",
    "hadamard_rotate",
    "last_num_threads",
    "plan",
    "scaled_dot_product_attention",
    "set_num_threads",
    "simd_target",
]
