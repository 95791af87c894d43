from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np

Array = Any  # numpy.ndarray (float32, float16, ml_dtypes.bfloat16) or torch.Tensor on the CPU
Window = Sequence[int]

def flash_attn_func(q: Array, k: Array, v: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Window = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, seed: Optional[int] = None,
                    kernel: str = "auto", backward_kernel: str = "auto",
                    num_threads: Optional[int] = None, num_splits: int = 0, block_mask: Optional[Array] = None,
                    block_mask_block_size: int = 0, q_descale: Optional[Array] = None,
                    k_descale: Optional[Array] = None,
                    v_descale: Optional[Array] = None,
    learnable_sink: Optional[Array] = None,
    sinks: Optional[Array] = None, pack_gqa: Optional[bool] = None) -> Union[Array, Tuple[Array, Array, Array]]: ...
def flash_attn_qkvpacked_func(qkv: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Window = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                              return_attn_probs: bool = False, *, seed: Optional[int] = None,
                    kernel: str = "auto", backward_kernel: str = "auto",
                              num_threads: Optional[int] = None, num_splits: int = 0,
                              block_mask: Optional[Array] = None,
                              block_mask_block_size: int = 0,
    learnable_sink: Optional[Array] = None,
    sinks: Optional[Array] = None, pack_gqa: Optional[bool] = None) -> Union[Array, Tuple[Array, Array, Array]]: ...
def flash_attn_kvpacked_func(q: Array, kv: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Window = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                             return_attn_probs: bool = False, *, seed: Optional[int] = None,
                    kernel: str = "auto", backward_kernel: str = "auto",
                             num_threads: Optional[int] = None, num_splits: int = 0,
                             block_mask: Optional[Array] = None,
                             block_mask_block_size: int = 0,
    learnable_sink: Optional[Array] = None,
    sinks: Optional[Array] = None, pack_gqa: Optional[bool] = None) -> Union[Array, Tuple[Array, Array, Array]]: ...
def flash_attn_varlen_func(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Window = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Array] = None, *,
                           seed: Optional[int] = None, kernel: str = "auto", backward_kernel: str = "auto",
                           num_threads: Optional[int] = None,
                           num_splits: int = 0, seqused_k: Optional[Array] = None,
                           k_scale: Optional[Array] = None, v_scale: Optional[Array] = None,
                           learnable_sink: Optional[Array] = None,
                           sinks: Optional[Array] = None, prefix_block_table: Optional[Array] = None,
                           prefix_seqused_k: Optional[Array] = None, prefix_idx: Optional[Array] = None,
                           k_zero_point: Optional[Array] = None, v_zero_point: Optional[Array] = None,
                           k_quant: Optional[str] = None,
                           v_quant: Optional[str] = None,
                           pack_gqa: Optional[bool] = None) -> Union[Array, Tuple[Array, Array, Array]]: ...
def flash_attn_varlen_qkvpacked_func(qkv: Array, cu_seqlens: Array, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Window = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *, seed: Optional[int] = None,
                    kernel: str = "auto", backward_kernel: str = "auto",
                                     num_threads: Optional[int] = None,
    learnable_sink: Optional[Array] = None,
    sinks: Optional[Array] = None) -> Union[Array, Tuple[Array, Array, Array]]: ...
def flash_attn_varlen_kvpacked_func(q: Array, kv: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Window = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, *, seed: Optional[int] = None,
                    kernel: str = "auto", backward_kernel: str = "auto",
                                    num_threads: Optional[int] = None,
    learnable_sink: Optional[Array] = None,
    sinks: Optional[Array] = None) -> Union[Array, Tuple[Array, Array, Array]]: ...
def flash_attn_with_kvcache(q: Array, k_cache: Array, v_cache: Array, k: Optional[Array] = None,
                            v: Optional[Array] = None, rotary_cos: Optional[Array] = None,
                            rotary_sin: Optional[Array] = None, cache_seqlens: Optional[Array] = None,
                            cache_batch_idx: Optional[Array] = None, cache_leftpad: Optional[Array] = None,
                            block_table: Optional[Array] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Window = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Array] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False, *,
                            k_scale: Optional[Array] = None, v_scale: Optional[Array] = None,
                            kernel: str = "auto", num_threads: Optional[int] = None,
    learnable_sink: Optional[Array] = None, sinks: Optional[Array] = None, cu_seqlens_q: Optional[Array] = None,
    cu_seqlens_k_new: Optional[Array] = None, max_seqlen_q: Optional[int] = None,
    k_zero_point: Optional[Array] = None, v_zero_point: Optional[Array] = None,
    k_quant: Optional[str] = None, v_quant: Optional[str] = None, pack_gqa: Optional[bool] = None) -> Any: ...
def flash_attn_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, softmax_lse: Array,
                        dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
                        window_size: Window = (-1, -1), softcap: float = 0.0, alibi_slopes: Optional[Array] = None,
                        deterministic: bool = False, *, seed: Optional[int] = None,
                        backward_kernel: str = "auto", num_threads: Optional[int] = None,
                        block_mask: Optional[Array] = None,
                        block_mask_block_size: int = 0,
    learnable_sink: Optional[Array] = None, sinks: Optional[Array] = None) -> Tuple[Array, Array, Array]: ...
def flash_attn_varlen_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, softmax_lse: Array,
                               cu_seqlens_q: Array, cu_seqlens_k: Array, max_seqlen_q: int, max_seqlen_k: int,
                               dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                               causal: bool = False, window_size: Window = (-1, -1), softcap: float = 0.0,
                               alibi_slopes: Optional[Array] = None, deterministic: bool = False, *,
                               seed: Optional[int] = None, backward_kernel: str = "auto",
                               num_threads: Optional[int] = None,
    learnable_sink: Optional[Array] = None, sinks: Optional[Array] = None) -> Tuple[Array, Array, Array]: ...
def flash_attn_combine(out_partial: Array, lse_partial: Array, out: Optional[Array] = None,
                       out_dtype: Any = None, *, num_threads: Optional[int] = None) -> Tuple[Array, Array]: ...
def hadamard_dim(head_dim: int) -> int: ...
def hadamard_rotate(x: Array, seed: int = 0) -> Array: ...
def plan(q: Array, k: Array, v: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
         causal: bool = False, window_size: Window = (-1, -1), softcap: float = 0.0,
         alibi_slopes: Optional[Array] = None, deterministic: bool = False, *, kernel: str = "auto",
         backward_kernel: str = "auto", num_threads: Optional[int] = None, num_splits: int = 0,
         block_mask: Optional[Array] = None, block_mask_block_size: int = 0,
         pack_gqa: Optional[bool] = None) -> Dict[str, Any]: ...
def scaled_dot_product_attention(query: Array, key: Array, value: Array, attn_mask: Optional[Array] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, softcap: float = 0.0,
                                 learnable_sink: Optional[Array] = None) -> Array: ...
class BlockMask:
    shape: Tuple[int, int, int, int]
    BLOCK_SIZE: Tuple[int, int]
    mask_mod: Callable[..., Any]
    @property
    def seq_lengths(self) -> Tuple[int, int]: ...
    def sparsity(self) -> float: ...
    def to_dense(self) -> Any: ...
    def to_states(self) -> Any: ...
def create_block_mask(mask_mod: Callable[..., Any], B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device: Any = "cpu", BLOCK_SIZE: Union[int, Tuple[int, int]] = 128) -> BlockMask: ...
def flex_attention(query: Array, key: Array, value: Array, score_mod: Optional[Callable[..., Any]] = None,
                   block_mask: Optional[BlockMask] = None, scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: None = None) -> Union[Array, Tuple[Array, Array]]: ...
def simd_target() -> str: ...
def set_num_threads(num_threads: int) -> None: ...
def get_num_threads() -> int: ...
def last_num_threads() -> int: ...
def install_as_flash_attn() -> bool: ...

__version__: str
