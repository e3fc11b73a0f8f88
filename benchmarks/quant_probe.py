"""Feasibility probe for issue 16's "quantized weights, kept quantized" on this CPU.

For smollm2's linear shapes it measures, per weight format (bf16 F.linear, int8 per-channel
`aten._weight_int8pack_mm`, int4 group-32 `aten._weight_int4pack_mm_for_cpu`, and hicache's native
int8 / int4 kernels of hicache/model/kernels/native.py on the same codes):

1. median time per call at M = 1, 8, 32, 512 rows (dense = F.linear on a weight in the activation dtype) and
   the weight bytes each call reads, against the bandwidth of a 256 MB tensor copy (bytes moved = read +
   write) and, at 512 rows, against a float32 2048x2048 matmul's FLOP/s, both measured in the same run;
2. row invariance: whether each row of a 64-row reference call equals, bit for bit, the same row
   computed alone (M=1, every row) and inside calls of 1..16, 37 and 517 rows at offsets 0 and 37
   (reference call: 80 rows),
   on random operands and on operands with cancelling large products (as calibration.py builds
   them) that make any change of summation order visible;
3. accuracy of int8 per-channel / int4 group-32 against the bf16 result on random activations.

Run:  PYTHONPATH=$PWD python benchmarks/quant_probe.py [--quick] [--dtype bf16|fp32|both]
"""

from __future__ import annotations

import argparse
import math
import platform
import subprocess
import time

import torch
import torch.nn.functional as F

from hicache.model.kernels import native, ops
from hicache.model.kernels.quant import QuantizedWeight

# SmolLM2-135M (the GGUF that `--model smollm2` loads): hidden 576, 9 query heads and 3 KV heads of
# 64, intermediate 1536, vocab 49152, 30 layers. (N, K) = (out_features, in_features).
HIDDEN, INTER, VOCAB, LAYERS, HEAD_DIM, HEADS, KV_HEADS = 576, 1536, 49152, 30, 64, 9, 3
SHAPES = {
    "q/o 576x576": (HIDDEN, HIDDEN),
    "k/v 192x576": (KV_HEADS * HEAD_DIM, HIDDEN),
    "gate/up 1536x576": (INTER, HIDDEN),
    "down 576x1536": (HIDDEN, INTER),
    "lm_head 49152x576": (VOCAB, HIDDEN),
}
# Calls per decode step of each shape: per layer q, o, k, v, gate, up, down; one lm_head.
PER_STEP = {
    "q/o 576x576": 2 * LAYERS,
    "k/v 192x576": 2 * LAYERS,
    "gate/up 1536x576": 2 * LAYERS,
    "down 576x1536": LAYERS,
    "lm_head 49152x576": 1,
}
TIMED_ROWS = (1, 8, 32, 512)
SMALL_ROWS = list(range(1, 17)) + [37]
LARGE_ROWS = 517
REFERENCE_ROWS = 80  # covers 37 rows at offset 37
OFFSETS = (0, 37)
GROUP = 32  # int4 group size: GGUF Q4_1 blocks are 32 weights with a scale and a minimum


# ---- the three kernels --------------------------------------------------------------------------


class Bf16Linear:
    name = "dense F.linear (act dtype)"

    def __init__(self, w: torch.Tensor, act: torch.dtype) -> None:
        self.w = w.to(act)  # the dense weight in the activation dtype (bf16 or fp32)

    def __call__(self, x):
        return F.linear(x, self.w)

    def weight_bytes(self):
        return self.w.numel() * self.w.element_size()


class Int8Linear:
    name = "int8 _weight_int8pack_mm"

    def __init__(
        self, w: torch.Tensor, act: torch.dtype, q: torch.Tensor | None = None, scales: torch.Tensor | None = None
    ) -> None:
        if q is None:  # symmetric per-output-channel quantization
            scales = (w.float().abs().amax(1) / 127).clamp_min(1e-12)
            q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.q, self.scales = q.contiguous(), scales.to(act).contiguous()

    def dequant(self):
        return self.q.float() * self.scales.float()[:, None]

    def __call__(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)

    def weight_bytes(self):
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


class Int4Linear:
    name = "int4 _weight_int4pack_mm_for_cpu g32"

    def __init__(
        self,
        w: torch.Tensor,
        act: torch.dtype,
        q: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        zero: torch.Tensor | None = None,
    ) -> None:
        n, k = w.shape
        if q is None:  # asymmetric per-group (like Q4_1): w = (q - 8) * scale + zero, q in 0..15
            g = w.float().view(n, k // GROUP, GROUP)
            lo, hi = g.amin(-1), g.amax(-1)
            s = ((hi - lo) / 15).clamp_min(1e-12)
            q = torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 15).view(n, k).to(torch.int32)
            scale, zero = s.t(), (lo + 8 * s).t()  # [K/G, N]
        self.q = q
        self.sz = torch.stack([scale, zero], -1).to(act).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)

    def dequant(self):
        s = self.sz[..., 0].float().t().repeat_interleave(GROUP, 1)
        z = self.sz[..., 1].float().t().repeat_interleave(GROUP, 1)
        return (self.q.float() - 8) * s + z

    def __call__(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.sz)

    def weight_bytes(self):
        return self.packed.numel() + self.sz.numel() * self.sz.element_size()


class NativeInt8Linear(Int8Linear):
    """hicache's native int8 kernel (hicache/model/kernels/native.py) on the same codes and scales."""

    name = "int8 hicache native"

    def __init__(self, w: torch.Tensor, act: torch.dtype, **codes) -> None:
        super().__init__(w, act, **codes)
        weight = QuantizedWeight(self.q, self.scales.float()[:, None], None, self.q.shape[1], 8, "probe")
        self.linear = ops.Linear(weight, ops.LinearPlan("native-int8", 1), act)

    def __call__(self, x):
        return self.linear(x)

    def weight_bytes(self):
        return self.linear.weight_bytes


class NativeInt4Linear(Int4Linear):
    """hicache's native int4 kernel on the same codes, scales and zeros (its offset = zero - 8 * scale)."""

    name = "int4 hicache native g32"

    def __init__(self, w: torch.Tensor, act: torch.dtype, **codes) -> None:
        super().__init__(w, act, **codes)
        scale, zero = (self.sz[..., i].float().t().contiguous() for i in (0, 1))
        weight = QuantizedWeight(self.q.to(torch.int8), scale, zero - 8 * scale, GROUP, 4, "probe")
        self.linear = ops.Linear(weight, ops.LinearPlan("native-int4", 1), act)

    def __call__(self, x):
        return self.linear(x)

    def weight_bytes(self):
        return self.linear.weight_bytes


def int4_available(act: torch.dtype) -> str:
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "op not in this torch build"
    try:
        Int4Linear(torch.randn(64, 64), act)(torch.randn(2, 64, dtype=act))
        return ""
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:80]


# ---- 1. speed ------------------------------------------------------------------------------------


def time_call(fn, x, budget_s: float) -> float:
    """The median time of one call (the median, not the mean: other jobs share this machine's cores)."""
    fn(x)  # warm up (and any one-time packing)
    times, start = [], time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
        if (t0 - start > budget_s and len(times) >= 3) or t0 - start > 4 * budget_s:
            return sorted(times)[len(times) // 2]


def fp32_flops() -> float:
    """GFLOP/s of a float32 2048x2048 matmul (MKL, all threads): the machine's practical fp32 peak."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / time_call(lambda _: a @ b, None, 1.0) / 1e9


def copy_bandwidth() -> float:
    """GB/s of a 256 MB tensor copy, counting read + write bytes; the best of 5."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


# ---- 2. row invariance ---------------------------------------------------------------------------


def probe_operands(kernel_cls, n, k, act, cancelling: bool, seed=0):
    """Kernel + inputs [LARGE_ROWS + 37, k]. With `cancelling`, each output also sums 4 pairs of
    equal and opposite large products (exact in every dtype) sized so that an fp32 rounding step
    of the partial sums is about a bf16 step of the small final result: any change of summation
    order then changes nearly every output (see calibration.probe_operands)."""
    gen = torch.Generator().manual_seed(seed)
    rows = LARGE_ROWS + max(OFFSETS)
    x = torch.randn(rows, k, generator=gen)
    if kernel_cls is Bf16Linear:
        w = torch.randn(n, k, generator=gen)
        wmax, make = 1.0, None
    elif issubclass(kernel_cls, Int8Linear):
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        # power-of-two scales (0.5, 1, 2): the integer and the real units of the partial sums agree
        scales = 2.0 ** torch.randint(-1, 2, (n,), generator=gen).float()
        wmax, w = 127, None
        make = lambda q=q, s=scales: kernel_cls(torch.empty(n, k), act, q=q.clone(), scales=s)
    else:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        s = 2.0 ** torch.randint(-1, 2, (n,), generator=gen).float()
        scale = s[None, :].expand(k // GROUP, n).contiguous()  # one scale per channel, zero 0: both
        zero = torch.zeros(k // GROUP, n)  # cancelling columns dequantize to the same value
        wmax, w = 7, None
        make = lambda q=q, sc=scale, z=zero: kernel_cls(torch.empty(n, k), act, q=q.clone(), scale=sc, zero=z)
    if cancelling:
        # typical |output| of the random part, then x = 2^e so that the products are ~2^16 larger
        probe = (Bf16Linear(w, act) if w is not None else make())(x[:64].to(act)).float()
        r = probe.abs().median().item()
        e = round(math.log2(max(r, 1e-3) * 2**16 / wmax))
        quarter = k // 4
        sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1, 1)
        for i in range(4):
            lo, hi = i * quarter // 4, k - 1 - i * quarter // 4
            x[:, lo], x[:, hi] = 2.0**e, -(2.0**e)
            if w is not None:
                w[:, lo] = w[:, hi] = sign * 1.0
            elif issubclass(kernel_cls, Int8Linear):
                q[:, lo] = q[:, hi] = (sign * 127).to(torch.int8)
            else:
                q[:, lo] = q[:, hi] = (8 + sign * 7).to(torch.int32)  # dequantizes to +-7 * scale
    kernel = kernel_cls(w, act) if w is not None else make()
    return kernel, x.to(act)


def invariance(kernel, x) -> list[str]:
    """The call sizes whose rows differ from the reference call's ('alone' = each row M=1)."""
    ref = kernel(x[:REFERENCE_ROWS].contiguous())
    broken = []
    for m in SMALL_ROWS:
        for off in OFFSETS:
            if not torch.equal(kernel(x[off : off + m].contiguous()), ref[off : off + m]):
                broken.append(f"{m}@{off}")
    alone = [i for i in range(REFERENCE_ROWS) if not torch.equal(kernel(x[i : i + 1].contiguous()), ref[i : i + 1])]
    if alone:
        broken.append(f"alone({len(alone)}/{REFERENCE_ROWS} rows)")
    if not torch.equal(kernel(x[:LARGE_ROWS].contiguous())[:REFERENCE_ROWS], ref):
        broken.append(str(LARGE_ROWS))
    return broken


# ---- 3. accuracy ---------------------------------------------------------------------------------


def accuracy(kernel_cls, n, k, act, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).float()  # a bf16 weight
    x = torch.randn(32, k, generator=gen).to(act)
    ref = F.linear(x.float().double(), w.double())  # exact product of the bf16 weight
    bf16 = F.linear(x, w.to(act)).double()
    kern = kernel_cls(w, act)
    out = kern(x).double()
    deq = F.linear(x.double(), kern.dequant().double())  # the quantized weight, exactly
    scale = ref.abs().max().item()
    return {
        "vs bf16 max abs": (out - bf16).abs().max().item(),
        "vs bf16 max rel": (out - bf16).abs().max().item() / scale,
        "vs bf16 rel L2": ((out - bf16).norm() / bf16.norm()).item(),
        "kernel vs own dequant max rel": (out - deq).abs().max().item() / scale,
        "bf16 F.linear vs exact max rel": (bf16 - ref).abs().max().item() / scale,
    }


# ---- main ----------------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter timing budget")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "both"))
    ap.add_argument("--skip-invariance", action="store_true")
    ap.add_argument("--skip-packed", action="store_true",
                    help="leave out aten's packed kernels (with fp32 activations one 512-row lm_head call takes seconds)")
    args = ap.parse_args()
    acts = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}[args.dtype]
    budget = 0.1 if args.quick else 0.3

    print(
        f"CPU: {cpu_name()}  capability {torch.backends.cpu.get_cpu_capability()}  "
        f"threads {torch.get_num_threads()}  torch {torch.__version__}"
    )
    bw = copy_bandwidth()
    peak = fp32_flops()
    print(f"tensor copy of 256 MB: {bw:.1f} GB/s (read + write bytes); fp32 matmul 2048^2: {peak:.0f} GFLOP/s\n")

    for act in acts:
        aname = str(act).removeprefix("torch.")
        kernels = [Bf16Linear] + ([] if args.skip_packed else [Int8Linear])
        why = int4_available(act)
        if why:
            print(f"int4 with {aname} activations unavailable: {why}")
        elif not args.skip_packed:
            kernels.append(Int4Linear)
        if native.library() is not None:
            kernels += [NativeInt8Linear, NativeInt4Linear]
        else:
            print("hicache's native kernels unavailable (see the warning above)")

        print(f"== 1. time per call, activations {aname} (us; bw-limit = weight bytes / copy GB/s) ==")
        head = f"{'shape':18} {'kernel':38} {'w MB':>7} {'bw-limit':>9}" + "".join(
            f"{'M=' + str(m):>10}" for m in TIMED_ROWS
        )
        print(head)
        step = {c.name: [0.0] * len(TIMED_ROWS) for c in kernels}
        step_bytes = {c.name: 0 for c in kernels}
        for sname, (n, k) in SHAPES.items():
            w = torch.randn(n, k) * 0.02
            for cls in kernels:
                kern = cls(w, act)
                times = [time_call(kern, torch.randn(m, k).to(act), budget) for m in TIMED_ROWS]
                wb = kern.weight_bytes()
                for i, t in enumerate(times):
                    step[cls.name][i] += t * PER_STEP[sname]
                step_bytes[cls.name] += wb * PER_STEP[sname]
                print(
                    f"{sname:18} {cls.name:38} {wb / 1e6:7.2f} {wb / bw / 1e3:9.1f}"
                    + "".join(f"{t * 1e6:10.1f}" for t in times)
                )
        print("\nall linears of one forward step (30 layers + lm_head), ms; tok/s at M=1 = 1 / step time;")
        print("GB/s M=1 = weight bytes / step time (x copy: against the copy's GB/s); GF M=512 = GFLOP/s at")
        print("512 rows (x peak: against the fp32 2048^2 matmul); x dense: the dense kernel's time / this one's")
        step_flops = 2 * sum(n * k * PER_STEP[sname] for sname, (n, k) in SHAPES.items()) * TIMED_ROWS[-1]
        dense = step[Bf16Linear.name]
        print(
            f"{'kernel':38} {'w MB':>7} {'bw-limit':>9}"
            + "".join(f"{'M=' + str(m):>10}" for m in TIMED_ROWS)
            + f"{'tok/s M=1':>11}{'GB/s M=1':>10}{'x copy':>8}{'GF M=512':>10}{'x peak':>8}"
            + "".join(f"{'x dense ' + str(m):>11}" for m in TIMED_ROWS)
        )
        for name, ts in step.items():
            gbs, gf = step_bytes[name] / ts[0] / 1e9, step_flops / ts[-1] / 1e9
            print(
                f"{name:38} {step_bytes[name] / 1e6:7.1f} {step_bytes[name] / bw / 1e6:9.2f}"
                + "".join(f"{t * 1e3:10.2f}" for t in ts)
                + f"{1 / ts[0]:11.1f}{gbs:10.1f}{gbs / bw:8.2f}{gf:10.1f}{gf / peak:8.2f}"
                + "".join(f"{d / t:11.2f}" for d, t in zip(dense, ts))
            )

        if not args.skip_invariance:
            print(
                f"\n== 2. row invariance, activations {aname}: call sizes (rows@offset) that differ from the "
                f"{REFERENCE_ROWS}-row call =="
            )
            for sname, (n, k) in SHAPES.items():
                for cls in kernels:
                    for cancelling in (False, True):
                        kern, x = probe_operands(cls, n, k, act, cancelling)
                        broken = invariance(kern, x)
                        label = "cancelling" if cancelling else "random"
                        print(
                            f"{sname:18} {cls.name:38} {label:10} "
                            + ("invariant" if not broken else "BREAKS at " + " ".join(broken))
                        )

        print(f"\n== 3. accuracy on random activations, weights N(0, 0.02) in bf16, activations {aname}, 32 rows ==")
        for sname, (n, k) in SHAPES.items():
            for cls in kernels[1:]:
                acc = accuracy(cls, n, k, act)
                print(f"{sname:18} {cls.name:38} " + "  ".join(f"{key} {v:.2e}" for key, v in acc.items()))
        print()


if __name__ == "__main__":
    main()
