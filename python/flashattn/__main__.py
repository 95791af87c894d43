"""python -m flashattn: the version, and what this CPU runs (SIMD target, kernels, threads)."""

import argparse
import importlib.util

from . import __version__, _C, get_num_threads


def report() -> str:
    hw = _C.cpu_hardware()
    forward = ["tiled", "decode"] + [k for k in ("tiled_bf16", "decode_fp16", "decode_bf16") if hw[k] == "1"]
    backward = ["tiled"] + (["tiled_bf16"] if hw["tiled_bf16"] == "1" else [])
    bf16 = "tiled_bf16" if hw["tiled_bf16_default"] == "1" else "tiled"
    lines = [
        f"flashattn {__version__}",
        f"SIMD target: {hw['simd_target']}",
        f"forward kernels: {', '.join(forward)}",
        f"backward kernels: {', '.join(backward)}",
        f"bfloat16 default kernel: {bf16}",
        f"caches: L1d {int(hw['l1d_bytes']) // 1024} KiB, L2 {int(hw['l2_bytes']) // 1024} KiB",
        f"threads (NumPy calls): {get_num_threads()}",
    ]
    if importlib.util.find_spec("torch") is not None:
        import torch

        lines.append(f"threads (torch tensors): {torch.get_num_threads()} (torch.get_num_threads(), torch "
                     f"{torch.__version__})")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashattn", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version only")
    args = parser.parse_args(argv)
    print(__version__ if args.version else report())


if __name__ == "__main__":
    main()
