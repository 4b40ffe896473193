#!/usr/bin/env python3
"""Print the AMD GPU targets a HIP shared object carries device code for, one per line, sorted.

usage: hip-offload-targets.py LIB.so
Reads the ELF section .hip_fatbin: a sequence of clang offload bundles ("__CLANG_OFFLOAD_BUNDLE__", an entry
count, then per entry offset, size, id length and id, all little-endian u64), one bundle per compiled source
file. An id is "hipv4-amdgcn-amd-amdhsa--gfx906" (optionally with features, "gfx90a:xnack-"); the host entry
("host-x86_64-unknown-linux-gnu-") is skipped. A target is printed only when every bundle has it (a kernel
file built for fewer targets would leave those cards without its kernels); the others are named on stderr.
Exit 1 when there is no .hip_fatbin or a bundle is compressed (clang's "CCOB" format, not read here).
"""
import mmap
import struct
import sys

MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"


def section(mm, name):
    """(offset, size) of the named section of a 64-bit little-endian ELF file."""
    if mm[:4] != b"\x7fELF" or mm[4] != 2 or mm[5] != 1:
        sys.exit(f"hip-offload-targets: {sys.argv[1]}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", mm, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", mm, 0x3A)
    def header(i):
        return struct.unpack_from("<IIQQQQ", mm, shoff + i * shentsize)  # name, type, flags, addr, offset, size
    strtab = header(shstrndx)
    for i in range(shnum):
        h = header(i)
        start = strtab[4] + h[0]
        if mm[start:mm.find(b"\0", start)] == name:
            return h[4], h[5]
    return None


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        sec = section(mm, b".hip_fatbin")
        if sec is None:
            sys.exit(f"hip-offload-targets: {sys.argv[1]}: no .hip_fatbin section")
        start, end = sec[0], sec[0] + sec[1]
        if mm.find(b"CCOB", start, end) >= 0 and mm.find(MAGIC, start, end) < 0:
            sys.exit(f"hip-offload-targets: {sys.argv[1]}: compressed offload bundles (CCOB), not read here")
        bundles = []
        pos = mm.find(MAGIC, start, end)
        while pos >= 0:
            n, = struct.unpack_from("<Q", mm, pos + len(MAGIC))
            p = pos + len(MAGIC) + 8
            targets = set()
            for _ in range(n):
                _off, _size, idlen = struct.unpack_from("<QQQ", mm, p)
                ident = mm[p + 24:p + 24 + idlen].decode()
                p += 24 + idlen
                if ident.startswith("host-"):
                    continue
                targets.add(ident.split("--", 1)[1] if "--" in ident else ident)
            bundles.append(targets)
            pos = mm.find(MAGIC, p, end)
    if not bundles:
        sys.exit(f"hip-offload-targets: {sys.argv[1]}: no offload bundle in .hip_fatbin")
    every = set.intersection(*bundles)
    some = set.union(*bundles) - every
    if some:
        print(f"hip-offload-targets: in only some of the {len(bundles)} bundles: {' '.join(sorted(some))}",
              file=sys.stderr)
    print(f"hip-offload-targets: {len(bundles)} bundles", file=sys.stderr)
    # gfx803 < gfx900 < gfx906 < gfx90a < gfx1010 (Debian's X-Rocm-Gpu-Architecture order)
    def key(t):
        name = t.split(":")[0]
        return (len(name), name, t)
    for t in sorted(every, key=key):
        print(t)


if __name__ == "__main__":
    main()
