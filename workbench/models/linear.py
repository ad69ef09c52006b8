"""A linear layer whose storage can be re-laid out (quantised) in place, keeping the original.

Modes: "none" (the original weights; bf16 on a CPU uses oneDNN's packed layout), "int8"
(weight-only, per-output-channel symmetric scales), "int4" (weight-only, group-wise
asymmetric), "fp8" (e4m3, per-output-channel; CUDA devices with fp8 support only). In bf16 on a
CPU the quantised matmuls are torch's packed weight-only kernels (and our GEMVs), never
dequantise-then-matmul. Those kernels are fast in bf16 only (float32: 40-150x slower at a
prefill's shape, minutes per step), so other dtypes on a CPU multiply by the exact dequantised
weights, kept beside the codes: the quantised values at that dtype's speed and memory.

With `native` set (the engine's `cpu_kernels` setting, bf16 on a CPU), batches of up to
`cpu.MAX_ROWS` rows -- decode steps -- take our GEMV kernels instead (workbench_kernels.cpu):
they stream the weights at the memory's rate, where oneDNN's and torch's kernels lose a third to
per-call overhead and short rows. Larger batches take the path `cpu.gemm_path` measured fastest:
our bf16 tiles (`tiled`, over a copy packed for them: the layers' at load, by
`Transformer.pack_tiles`), oneDNN in bf16 where this CPU multiplies bf16 natively, or (`wide`)
oneDNN in fp32 over an fp32 copy of the weights, made on first use. A quantisation drops these
layouts of the originals, which serve mode "none" only.

Where the tiles stream a decode's weights as fast as the GEMVs (`cpu.tiles_hold_weights`) and the
layer owns its weights (`own`), the tiles are the originals' own bytes laid out anew (`hold_once`):
every step multiplies there and the bf16 weights are held once. `weight` is then a copy made on
request; a quantisation or the torch path lays the bytes back first (`LAYOUT_LOCK` orders that with
readers on other threads: the checksum).

Every copy of the originals (the tiles', oneDNN's, fp32) is made only where the engine's host
memory affords it (`memory`, `models.host_memory`); otherwise the layer serves without it
(`skipped`): the tiles' layout in place, oneDNN over the plain weights, an fp32 copy per call.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from workbench_kernels import cpu

QUANT_MODES = ("none", "int8", "int4", "fp8")
LAYOUT_LOCK = threading.RLock()  # held while a weight's bytes change layout, and by readers of them


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, own: bool = False):
        self._weight = weight  # the original weights (laid out as the tiles while `held_once`; None: dropped)
        self.shape, self.dtype, self.device = tuple(weight.shape), weight.dtype, weight.device
        self.own = own  # this layer alone reads `weight`'s bytes: they may be laid out anew in place
        self.held_once = False
        self.bias = bias
        self.mode = "none"
        self.group_size = 0
        self._packed: torch.Tensor | None | bool = False  # oneDNN's layout, made on first use (False: not yet)
        # fp32 (packed or None, plain or None, bias) for `wide` steps, made on first use
        self._wide: tuple | None = None
        self._q: tuple = ()
        self._deq: tuple | None = None  # (dequantised weights, their oneDNN layout or None): see the module doc
        self._native: cpu.Gemv | None = None  # the current mode's weights bound to our GEMV kernel
        self._tiles: cpu.Tiles | None = None  # the original weights packed for our tiles (`fused_tiles`)
        self.native = False
        self.wide = False
        self.tiled = False
        self.memory = None  # a `HostMemory` asked before any copy of the weights (None: no bound)
        self.skipped: set[str] = set()  # copies not made for want of memory, until the next re-layout
        self.quantize("none")

    @property
    def weight(self) -> torch.Tensor:
        """The original [N, K] weights (a copy while the tiles hold them: `hold_once`)."""
        if self.held_once:
            return self.weight_rows(0, self.shape[0])
        self._require_original()
        return self._weight

    def weight_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of the original weights (a copy of them while the tiles hold them)."""
        self._require_original()
        if self.held_once:
            with LAYOUT_LOCK:
                if self.held_once:
                    return self._tiles.weight(start, stop)
        return self._weight[start:stop]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` ([T]) of the original weights, wherever they lie: a tied embedding's lookup."""
        if self.held_once:
            return self._tiles.rows(ids)
        self._require_original()
        return F.embedding(ids, self._weight)

    @property
    def storage(self) -> torch.Tensor:
        """The tensor holding the original weights, in whichever layout."""
        return self._weight

    def hold_once(self, short_of_memory: bool = False) -> bool:
        """Lay the original weights out as the tiles in their own bytes, where this layer owns them,
        multiplies unquantised on the tiles, and the tiles stream decodes as fast as the GEMVs here
        (or a copy for them does not fit: `short_of_memory`); then every step takes the tiles.
        Returns whether the weights are held once."""
        tiles_serve = self.native and self.tiled and self.mode == "none"
        if not self.held_once and self.own and tiles_serve and cpu.holds_in_place(self._weight):
            if short_of_memory or cpu.tiles_hold_weights()[0]:
                with LAYOUT_LOCK:
                    self._tiles = cpu.Tiles(self._weight, self.bias, in_place=True)
                    self._native, self._packed, self._wide = self._tiles, False, None
                    self.held_once = True
        return self.held_once

    def drop_original(self) -> None:
        """Forget the original weights of a quantised layer that is never re-laid out (a self-int4
        draft's, rebuilt from its model to change): its codes alone stay."""
        if self.mode == "none":
            raise ValueError("an unquantised layer multiplies by its original weights: nothing to drop")
        self._weight = None

    def _require_original(self) -> None:
        if self._weight is None:
            raise RuntimeError(f"this layer dropped its original weights (`drop_original`): {self.mode} only")

    def _lay_back(self) -> None:
        """The original weights in their own layout again (before anything but the tiles reads them)."""
        if self.held_once:
            with LAYOUT_LOCK:
                self._tiles.release()
                self._tiles, self._native, self.held_once = None, None, False

    def bind(self, native: bool, wide: bool, tiled: bool) -> None:
        """Which kernels serve: ours (`native`; large steps in fp32 oneDNN if `wide`, on the tiles if
        `tiled`) or torch's."""
        if self.held_once and not (native and tiled):
            self.quantize(self.mode, self.group_size or 128)  # laid back, bound to the GEMV again
        if (native, wide, tiled) != (self.native, self.wide, self.tiled):
            self.skipped = set()  # another path's copies: asked for anew
        self.native, self.wide, self.tiled = native, wide, tiled

    def quantize(self, mode: str, group_size: int = 128) -> None:
        """Re-lay out from the original weights: any mode is reachable from any other."""
        if mode not in QUANT_MODES:
            raise ValueError(f"invalid value {mode!r} for setting 'quantization'; allowed: {QUANT_MODES}")
        if mode == "fp8" and not fp8_supported(self.device):
            raise ValueError(f"quantization='fp8' is not supported on this device ({self.device})")
        self._require_original()
        self._lay_back()
        self.skipped = set()
        self._q = ()
        self._native = None
        self._deq = None
        if mode != "none":  # the originals' other layouts serve mode "none" only: made again on its first use
            self._tiles, self._packed, self._wide = None, False, None
        w = self.weight
        native_ok = w.device.type == "cpu" and w.dtype == torch.bfloat16 and cpu.available()
        weight_only_kernels = w.device.type != "cpu" or w.dtype == torch.bfloat16
        if mode == "none" and native_ok:
            self._native = cpu.Gemv("bf16", w, bias=self.bias)
        elif mode == "int8":
            self._q = quantize_int8(w)
            if native_ok and w.shape[1] % 16 == 0:
                self._native = cpu.Gemv("int8", *self._q, self.bias)
            if not weight_only_kernels:
                q, scale = self._q
                self._deq = _dense(q.to(w.dtype) * scale[:, None])
        elif mode == "int4":
            self.group_size = int4_group_size(w.shape[1], group_size)
            codes, scales_zeros = int4_codes(w, self.group_size)
            if native_ok and w.shape[1] % 32 == 0 and self.group_size % 32 == 0:
                self._native = cpu.Gemv("int4", *native_int4(codes, scales_zeros), self.bias, self.group_size)
            # torch's packed copy of the codes only where large steps need it (not on AMX's tiles)
            if self._native is None or not cpu.codes_on_tiles(cpu.quant_gemv_rows() + 1, w.shape[1]):
                self._q = int4_torch_operands(codes, scales_zeros, w.dtype)
            if not weight_only_kernels:
                self._deq = _dense(self._q[2])
        elif mode == "fp8":
            scale = w.float().abs().amax(1).clamp(min=1e-8) / 448.0
            self._q = ((w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale.to(w.dtype))
        self.mode = mode

    @property
    def gemv(self) -> cpu.Gemv | None:
        """The current mode's weights bound to our GEMV kernel (None: no kernel for this mode here)."""
        return self._native

    def dequantized(self) -> torch.Tensor:
        """The weights this layer effectively multiplies by (for error reports)."""
        if self.mode == "none":
            return self.weight
        if self.mode == "int8":
            q, s = self._q
            return (q.float() * s.float()[:, None]).to(self.dtype)
        if self.mode == "int4":
            if not self._q:  # AMX's tiles, from the GEMV's codes: each weight rounded to bf16 as they widen it
                codes, scale_zero, _ = self._native.operands
                return int4_weights(cpu.unpack_int4(codes), scale_zero, self.group_size).to(self.dtype)
            packed, scales_zeros, deq = self._q
            if deq is not None:
                return deq
            # Ask the kernel itself: x = I gives W^T exactly as it multiplies.
            eye = torch.eye(self.shape[1], dtype=self.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, self.group_size, scales_zeros).t()
        q, s = self._q
        return (q.float() * s.float()[:, None]).to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mode = self.mode
        if self.held_once:  # the tiles take every step
            return self._tiles(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], -1)
        gemv_rows = cpu.MAX_ROWS if mode == "none" else cpu.quant_gemv_rows()
        if self.native and self._native is not None and x.dim() == 2 and x.shape[0] <= gemv_rows:
            if not (self.tiled and mode == "none" and cpu.tiles_take(x.shape[0], x.shape[1])):
                return self._native(x if x.is_contiguous() else x.contiguous())
        if self._deq is not None:
            w, packed = self._deq
            return F.linear(x, w, self.bias) if packed is None else cpu.packed_linear(x, packed, self.bias)
        if mode == "none":
            tiles = self.fused_tiles() if x.dim() == 2 else None
            if tiles is not None:
                return tiles(x if x.is_contiguous() else x.contiguous())
            if self.native and self.wide:
                return self._wide_linear(x)
            if self.onednn_packed() is not None:
                return cpu.packed_linear(x, self._packed, self.bias)
            return F.linear(x, self.weight, self.bias)
        if mode in ("int8", "int4") and self.native and self._native is not None and x.dim() == 2:
            if cpu.codes_on_tiles(*x.shape):  # bf16 on a CPU, many rows, AMX: the codes widened onto the tiles
                codes, aux, _ = self._native.operands  # int8: (codes, scale); int4: (nibbles, scale and zero)
                if mode == "int8":
                    return cpu.gemm_q8_tiles(x.contiguous(), codes, aux, self.bias)
                return cpu.gemm_q4_tiles(x.contiguous(), codes, aux, self.bias, self.group_size)
        if mode == "int8":
            q, s = self._q
            if x.device.type == "cpu":
                y = torch.ops.aten._weight_int8pack_mm(x, q, s.to(x.dtype))
            else:
                y = F.linear(x, q.to(x.dtype)) * s.to(x.dtype)
        elif mode == "int4":
            packed, scales_zeros, _ = self._int4_operands()
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            if packed is not None:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self.group_size, scales_zeros.to(x.dtype))
            else:
                y = F.linear(x2, self._q[2].to(x.dtype))
            y = y.reshape(*shape[:-1], -1)
        else:
            q, s = self._q
            y = F.linear(x, q.to(x.dtype)) * s.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _int4_operands(self) -> tuple:
        """torch's int4 operands (packed codes, scales and zeros, dequantised copy or None), made
        from the GEMV's codes where quantize did not (AMX's tiles take the large steps)."""
        if not self._q:
            codes, scale_zero, _ = self._native.operands
            self._q = int4_torch_operands(cpu.unpack_int4(codes), scale_zero.transpose(0, 1).contiguous(), self.dtype)
        return self._q

    def copies_bytes(self) -> dict[str, int]:
        """Bytes of what this layer holds beside its original weights, by what each copy is for:
        "tiles" and "onednn" (the originals re-laid out for a kernel), "quantized" (codes and
        scales), "dequantized" (their exact weights, where no quantised kernel runs), "fp32" (the
        wide path's copy)."""
        kept = {id(self._weight), id(self.bias)}
        out: dict[str, int] = {}

        def add(kind: str, *tensors) -> None:
            for t in tensors:
                if isinstance(t, torch.Tensor) and id(t) not in kept:
                    kept.add(id(t))
                    out[kind] = out.get(kind, 0) + t.nbytes

        add("tiles", not self.held_once and self._tiles and self._tiles.packed)
        add("onednn", self._packed)
        add("quantized", *self._q, *(self._native.operands if self._native is not None and not self.held_once else ()))
        add("dequantized", *(self._deq or ()))
        add("fp32", *(self._wide or ()))
        return out

    def codes_bytes(self, mode: str) -> int:
        """About what a quantisation to `mode` holds beside the originals: codes, and scales (and
        zeros) at most one pair per 32 inputs."""
        n, k = self.shape
        per_weight = 1.0  # int8 and fp8
        if mode == "int4":  # the GEMV's nibbles, and torch's packed copy unless AMX's tiles take large steps
            per_weight = 0.5 if cpu.codes_on_tiles(cpu.quant_gemv_rows() + 1, k) else 1.0
        return int(per_weight * n * k) + 4 * n * (k // 32 + 1)

    def onednn_packed(self) -> torch.Tensor | None:
        """The original weights in oneDNN's layout (made on first use), or None where torch has no
        oneDNN."""
        if self._packed is False:
            self._packed = cpu.pack_linear(self.weight) if self._may_copy(self._weight.nbytes, "onednn") else None
        return self._packed

    def fused_tiles(self) -> cpu.Tiles | None:
        """The original bf16 weights packed for our tiles (made at the first call), when large steps take
        them: on the tiles path, unquantised, an even number of inputs."""
        if not (self.native and self.tiled and self.mode == "none" and self._weight.shape[1] % 2 == 0):
            return None
        if self._tiles is None:
            if "tiles" in self.skipped:  # refused for memory and not holdable in place: asked once
                return None
            n, k = self.shape
            padded = -(-n // cpu.TILE_OUTPUTS) * cpu.TILE_OUTPUTS * k * 2
            if self._may_copy(padded, "tiles"):
                self._tiles = cpu.Tiles(self._weight, self.bias)
            elif not self.hold_once(short_of_memory=True):  # else no tiles: the GEMVs and oneDNN serve
                return None
        return self._tiles

    def _may_copy(self, nbytes: int, kind: str) -> bool:
        """Whether a copy of the weights of `kind` may be made (`HostMemory.affords`); a copy refused
        is not asked for again until the next re-layout."""
        if kind in self.skipped:
            return False
        if self.memory is None or self.memory.affords(nbytes):
            return True
        self.skipped.add(kind)
        return False

    def _wide_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self._wide is None and not self._may_copy(2 * self._weight.nbytes, "fp32"):
            # no room to keep the fp32 copy: one made for this call, a layer at a time
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self._weight.float(), bias).to(x.dtype)
        if self._wide is None:
            w32 = self.weight.float()
            packed = cpu.pack_linear(w32, cpu.WIDE_BATCH_HINT)
            self._wide = (packed, None if packed is not None else w32, None if self.bias is None else self.bias.float())
        packed, w32, b32 = self._wide
        y = F.linear(x.float(), w32, b32) if packed is None else cpu.packed_linear(x.float(), packed, b32)
        return y.to(x.dtype)


def _dense(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dequantised weights and their oneDNN layout (packed now: a re-layout, not the next step, pays)."""
    return w, cpu.pack_linear(w)


# Quantisers work in fp32 on this many bytes of rows at a time: over a whole matrix their fp32
# temporaries took ~3x its fp32 size at once (an 8B model's output head: 6 GB beside 1 GB of weights).
QUANTIZE_CHUNK_BYTES = 32 << 20


def _row_chunks(w: torch.Tensor):
    step = max(1, QUANTIZE_CHUNK_BYTES // (4 * w.shape[1]))
    for r in range(0, w.shape[0], step):
        yield r, w[r : r + step].to(torch.float32, copy=True)  # the callers work in place on it


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (codes [N, K] int8, scales [N] in w's dtype)."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r, wf in _row_chunks(w):
        s = wf.abs().amax(1).clamp(min=1e-8) / 127.0
        q[r : r + len(wf)] = wf.div_(s[:, None]).round_().clamp_(-127, 127)
        scale[r : r + len(wf)] = s
    return q, scale.to(w.dtype)


def int4_group_size(in_features: int, wanted: int) -> int:
    """The configured group size, or the largest smaller power of two that divides the row
    (SmolLM2's 576-wide rows take 64 when 128 is asked for)."""
    g = wanted
    while g > 16 and in_features % g:
        g //= 2
    if in_features % g:
        raise ValueError(f"int4 quantisation needs in_features divisible by a group size; got {in_features}")
    return g


def int4_codes(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups in torch's convention, w ~= (q - 8) * scale + zero, q in 0..15.
    Returns (codes [out, in] uint8, scales_and_zeros [groups, out, 2] in w's dtype)."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    sz = torch.empty(n, k // group_size, 2, dtype=torch.float32, device=w.device)
    for r, wf in _row_chunks(w):
        wf = wf.view(len(wf), k // group_size, group_size)
        lo, hi = wf.amin(-1, keepdim=True), wf.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        codes[r : r + len(wf)] = wf.sub_(lo).div_(scale).round_().clamp_(0, 15).view(len(wf), k)
        sz[r : r + len(wf), :, 0] = scale.squeeze(-1)
        sz[r : r + len(wf), :, 1] = (lo + 8 * scale).squeeze(-1)
    return codes, sz.transpose(0, 1).contiguous().to(w.dtype)


def int4_torch_operands(codes: torch.Tensor, scales_zeros: torch.Tensor, dtype: torch.dtype):
    """(packed, scales_and_zeros, dequantised copy): bf16 on a CPU gets torch's packed kernel and no
    copy; other dtypes and devices multiply by the dequantised copy."""
    if codes.device.type == "cpu" and dtype == torch.bfloat16:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        return packed, scales_zeros, None
    n, k = codes.shape
    scale, zero = scales_zeros.float().transpose(0, 1).unbind(-1)
    g = k // scale.shape[1]
    deq = (codes.view(n, -1, g).float() - 8) * scale[..., None] + zero[..., None]
    return None, scales_zeros, deq.view(n, k).to(dtype)


def int4_weights(codes: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    """(q - 8) * scale + zero in fp32, [N, K], from codes [N, K] and the GEMV's (scale, zero) [N, K / group, 2]."""
    n, k = codes.shape
    sz = scale_zero.float()
    return ((codes.float().view(n, -1, group) - 8) * sz[..., :1] + sz[..., 1:]).view(n, k)


def native_int4(codes: torch.Tensor, scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernel's operands: nibble-packed codes and bf16 (scale, zero) [out, groups, 2], torch's
    own values and convention w = (q - 8) * scale + zero, so both kernels multiply by the same weights."""
    return cpu.pack_int4(codes), scales_zeros.transpose(0, 1).to(torch.bfloat16).contiguous()


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
