"""Minimal .npy read/write without numpy, for the CLI smoke test (CI machines need not have numpy)."""
import struct

_FORMATS = {"<f4": "f", "<i4": "i", "|u1": "B"}


def save(path, shape, values, descr="<f4"):
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (
        descr, "".join(f"{s}, " for s in shape))
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack("<%d%s" % (len(values), _FORMATS[descr]), *values))


def load(path):
    """Returns (header text, flat list of float32 values)."""
    data = open(path, "rb").read()
    hlen = struct.unpack("<H", data[8:10])[0]
    header = data[10:10 + hlen].decode()
    assert "'<f4'" in header, header
    body = data[10 + hlen:]
    return header, list(struct.unpack("<%df" % (len(body) // 4), body))
