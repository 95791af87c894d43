"""A bench/ script where its peer library cannot be imported: one clear line, a successful
exit (main returns 0, or True where its exit status is `0 if main() else 1`).

    python3 tests/compare_without_peer.py SCRIPT MODULE EXPECTED_LINE
"""
import contextlib
import io
import runpy
import sys

script, module, expected = sys.argv[1:]
sys.modules[module] = None  # `import MODULE` now raises ImportError, as where it is not installed
main = runpy.run_path(script)["main"]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main([])
assert rc is True or (type(rc) is int and rc == 0), rc
assert out.getvalue() == expected + "\n", out.getvalue()
print(f"{script} without {module}: ok")
