"""bench/compare_torch.py where torch cannot be imported: one clear line, exit status 0."""
import contextlib
import io
import runpy
import sys

sys.modules["torch"] = None  # `import torch` now raises ImportError, as where it is not installed
main = runpy.run_path(sys.argv[1])["main"]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main([])
assert rc == 0, rc
assert out.getvalue() == "compare_torch: PyTorch is not importable here, nothing to compare (it is optional)\n", out.getvalue()
print("compare_torch without torch: ok")
