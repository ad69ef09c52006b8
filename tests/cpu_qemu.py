"""The NEON variant of the CPU kernels on an x86 host: cross-compiled with Debian's aarch64 gcc into
a small driver (tests/cpu_driver.c) that qemu-aarch64 runs, one kernel call per process, on buffers
the tests pass in files. `QemuKernels` has the call signatures of `workbench_kernels.cpu`, so the
kernel tests run the same inputs and torch references through it as through the in-process
variants."""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import torch
from workbench_kernels import cpu

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
DRIVER = Path(__file__).with_name("cpu_driver.c")


def unavailable_reason() -> str | None:
    """Why the NEON build cannot be run here, or None."""
    if cpu._arch() == "aarch64":
        return "an aarch64 host runs the neon variant in-process"
    missing = [t for t in (CROSS_CC, QEMU) if shutil.which(t) is None]
    if missing:
        return (
            f"NEON variant not tested: {' and '.join(missing)} not on PATH "
            "(apt-get install gcc-aarch64-linux-gnu qemu-user; `make test` does where apt works)"
        )
    return None


def build(out_dir: Path) -> Path:
    exe = out_dir / "wb-cpu-driver-neon"
    flags = [f for f in cpu.COMMON_FLAGS if f != "-fPIC"]  # an executable, not a shared library
    cmd = [CROSS_CC, *flags, *cpu.VARIANT_FLAGS["neon"], "-I", str(cpu.HERE), str(DRIVER), "-o", str(exe), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"cross-compiling the NEON driver failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return exe


def _raw(t: torch.Tensor | None) -> bytes:
    if t is None:
        return b""
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


class QemuKernels:
    variant = "neon (qemu-aarch64)"
    MAX_ROWS = cpu.MAX_ROWS
    pack_int4 = staticmethod(cpu.pack_int4)

    def __init__(self, exe: Path):
        self.exe = exe

    def _call(self, op: int, bufs: list[torch.Tensor | None], ints: list[int], floats: list[float] = ()):
        """Runs op on copies of `bufs`; copies the buffers back into them (outputs included)."""
        payload = [struct.pack("<qq", op, len(bufs))]
        for b in bufs:
            raw = _raw(b)
            payload += [struct.pack("<q", len(raw)), raw]
        payload += [struct.pack("<q", len(ints)), struct.pack(f"<{len(ints)}q", *ints)]
        payload += [struct.pack("<q", len(floats)), struct.pack(f"<{len(floats)}f", *floats)]
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "in", Path(tmp) / "out"
            src.write_bytes(b"".join(payload))
            r = subprocess.run(
                [QEMU, "-L", SYSROOT, str(self.exe), str(src), str(dst)], capture_output=True, text=True, timeout=120
            )
            assert r.returncode == 0, f"the NEON driver failed ({r.returncode}): {r.stderr[-1000:]}"
            assert r.stdout.strip() == "neon", f"the driver was built for {r.stdout.strip()!r}"
            data = dst.read_bytes()
        off = 0
        for b in bufs:
            n = len(_raw(b))
            if n:
                b.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(data[off : off + n]), dtype=torch.uint8))
            off += n

    def gemv_bf16(self, x, w, bias=None):
        m, k = x.shape
        y = torch.empty(m, w.shape[0], dtype=torch.bfloat16)
        self._call(0, [x, w, bias, y], [m, w.shape[0], k])
        return y

    def gemv_int8(self, x, q, scale, bias=None):
        m, k = x.shape
        y = torch.empty(m, q.shape[0], dtype=torch.bfloat16)
        self._call(1, [x, q, scale, bias, y], [m, q.shape[0], k])
        return y

    def gemv_int4(self, x, q, scale_zero, group, bias=None):
        m, k = x.shape
        y = torch.empty(m, q.shape[0], dtype=torch.bfloat16)
        self._call(2, [x, q, scale_zero, bias, y], [m, q.shape[0], k, group])
        return y

    def add_rms_norm(self, x, delta, weight, eps):
        t, h = x.shape
        out = torch.empty_like(x)
        self._call(3, [x, delta, weight, out], [t, h], [eps])
        return out

    def silu_mul(self, gate_up):
        t, two_i = gate_up.shape
        out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
        self._call(4, [gate_up, out], [t, two_i // 2])
        return out

    def rope_write_kv(self, qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, num_q_heads):
        _, _, hkv, d = k_cache.shape
        t = qkv.shape[0]
        q = torch.empty(t, num_q_heads, d, dtype=qkv.dtype)
        self._call(5, [qkv, positions, cos, sin, slot_mapping, q, k_cache, v_cache], [t, num_q_heads, hkv, d])
        return q

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, sm_scale):
        b, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        tables = block_tables.to(torch.int32).contiguous()
        out = torch.empty_like(q)
        self._call(
            6,
            [q, k_cache, v_cache, tables, seq_lens.to(torch.int32), out],
            [b, hq, hkv, d, bs, tables.shape[1]],
            [sm_scale],
        )
        return out

    def extend_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sm_scale):
        t, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        tables = block_tables.to(torch.int32).contiguous()
        out = torch.empty_like(q)
        self._call(
            8,
            [q, k_cache, v_cache, tables, cu_seqlens_q.to(torch.int32), seq_lens.to(torch.int32), out],
            [seq_lens.shape[0], hq, hkv, d, bs, tables.shape[1]],
            [sm_scale],
        )
        return out

    def decode_layer(self, weights, ln1, ln2, eps, step: dict, x, delta, k_cache, v_cache):
        """One bf16 layer (weights: qkv, o, gate_up, down) on the step's tensors; x in place; returns
        the MLP output."""
        t, h = x.shape
        out = torch.empty_like(x)
        s = step
        self._call(
            7,
            [
                *weights,
                ln1,
                ln2,
                s["positions"],
                s["slots"],
                s["tables"],
                s["lens"],
                s["cos"],
                s["sin"],
                x,
                delta,
                out,
                k_cache,
                v_cache,
            ],
            [t, h, s["heads"], s["kv_heads"], s["head_dim"], s["intermediate"], s["tables"].shape[1], k_cache.shape[1]],
            [eps, s["scale"]],
        )
        return out
