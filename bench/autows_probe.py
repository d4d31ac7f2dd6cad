"""Probe: does Triton's own Hopper warp specialization (``tl.range(..., warp_specialize=True)``) pay?

    python bench/autows_probe.py [--rounds 3]
    python bench/autows_probe.py --compile-only     # no GPU needed: what the compiler makes of it

Triton 3.6 (and 3.9) warp-specialize a persistent Hopper GEMM only when its TMA descriptors are
made in the kernel (``tl.make_tensor_descriptor``) and it runs 4 warps: the tile loop becomes a
producer warpgroup issuing the TMA loads (running ahead across tiles) and two consumer
warpgroups, each computing and finishing one 64-row half of the 128 x 256 tile (12 warps in
all). With descriptors passed from the host, as codetta's kernels take them, the pass does
nothing at 8 warps and fails at 4 (docs/internals.md). The epilogue stays in the consumers and
the aux tiles' loads with it: what can change is that the next tile's operands are in flight
during the epilogue. This probe times a small stand-alone kernel in both forms, with three
epilogues (store only; SiLU; codetta's residual + norm producer: x = acc + r, u = x g, row sums
of x^2), against cuBLAS and codetta's tuned kernels for the same programs, at the Llama-3 8B
shapes. Outputs are checked against PyTorch first; a wrong kernel is reported and not timed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"o_proj": (16384, 4096, 4096), "down_proj": (16384, 4096, 14336), "gate_up": (16384, 28672, 4096),
          "qkv": (16384, 6144, 4096)}
EPILOGUES = {"o_proj": ("plain", "residual"), "down_proj": ("plain", "residual"), "gate_up": ("plain", "silu"),
             "qkv": ("plain",)}
# (BM, BN, warps, warp_specialize): 4 warps with warp_specialize make 12 (a producer, two consumers)
VARIANTS = {"persistent 128x256 8w": (128, 256, 8, False), "autoWS 128x256": (128, 256, 4, True),
            "autoWS 256x128": (256, 128, 4, True)}
GROUP_M = 8


@triton.jit
def probe_gemm(a, b, c, r, g, u, sumsq, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               NUM_SMS: tl.constexpr, WS: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr):
    """c = epilogue(a b^T), a [M, K], b [N, K] row-major bf16; persistent over grouped tiles."""
    a_desc = tl.make_tensor_descriptor(a, [M, K], [K, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b, [N, K], [K, 1], [BN, BK])
    c_desc = tl.make_tensor_descriptor(c, [M, N], [N, 1], [BM, BN])
    r_desc = tl.make_tensor_descriptor(r, [M, N], [N, 1], [BM, BN])
    u_desc = tl.make_tensor_descriptor(u, [M, N], [N, 1], [BM, BN])
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, warp_specialize=WS):
        in_group = GROUP * num_n
        first_m = (tile // in_group) * GROUP
        rows_in_group = min(num_m - first_m, GROUP)
        off_m = (first_m + (tile % in_group) % rows_in_group) * BM
        pid_n = (tile % in_group) // rows_in_group
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            acc = tl.dot(a_desc.load([off_m, k * BK]), b_desc.load([off_n, k * BK]).T, acc)
        if EPI == "plain":
            c_desc.store([off_m, off_n], acc.to(tl.bfloat16))
        elif EPI == "silu":
            c_desc.store([off_m, off_n], (acc * tl.sigmoid(acc)).to(tl.bfloat16))
        else:
            x = (acc + r_desc.load([off_m, off_n]).to(tl.float32)).to(tl.bfloat16)
            c_desc.store([off_m, off_n], x)
            cols = off_n + tl.arange(0, BN)
            gamma = tl.load(g + cols, mask=cols < N, other=0.0).to(tl.float32)
            xf = x.to(tl.float32)
            u_desc.store([off_m, off_n], (xf * gamma[None, :]).to(tl.bfloat16))
            rows = off_m + tl.arange(0, BM)
            tl.store(sumsq + pid_n * M + rows, tl.sum(xf * xf, axis=1), mask=rows < M)


def run_probe(a, b, epilogue, variant, r=None, g=None):
    """Launch the probe kernel; returns (c, u, row sums of squares)."""
    BM, BN, warps, ws = VARIANTS[variant]
    (M, K), N = a.shape, b.shape[0]
    c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    u = torch.empty_like(c) if epilogue == "residual" else c
    r = c if r is None else r
    g = c if g is None else g
    sumsq = torch.empty(triton.cdiv(N, BN), M, device=a.device, dtype=torch.float32)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(sms, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    probe_gemm[grid](a, b, c, r, g, u, sumsq, M, N, K, BM=BM, BN=BN, BK=64, NUM_SMS=sms, WS=ws, EPI=epilogue,
                     GROUP=GROUP_M, num_warps=warps, num_stages=3)
    return c, u, sumsq.sum(0)


def compile_only():
    """What Triton makes of each variant for sm_90: warp_specialize ops, warps, shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "*bf16" for name in ("a", "b", "c", "r", "g", "u")}
    signature.update(sumsq="*fp32", M="i32", N="i32", K="i32")
    signature.update({name: "constexpr" for name in ("BM", "BN", "BK", "NUM_SMS", "WS", "EPI", "GROUP")})
    for epilogue in ("plain", "silu", "residual"):
        for variant, (BM, BN, warps, ws) in VARIANTS.items():
            source = ASTSource(probe_gemm, signature, constexprs=dict(BM=BM, BN=BN, BK=64, NUM_SMS=132, WS=ws,
                                                                       EPI=epilogue, GROUP=GROUP_M))
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": 3})
            ttgir = compiled.asm["ttgir"]
            print(f"{epilogue:9s} {variant:22s} warp_specialize ops {ttgir.count('ttg.warp_specialize')}, "
                  f"{compiled.metadata.num_warps} warps, {compiled.metadata.shared} B shared")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        os.environ["TRITON_INTERPRET"] = "0"
        compile_only()
        return
    import codetta
    from codetta import epilogue as ep
    from codetta.ops import rmsnorm

    from common import gemm_operands, graph_ms_in_rounds, markdown_table, require_gpu, write_results

    require_gpu("autows_probe")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    producer = rmsnorm._producer(torch.bfloat16, True, False)
    silu = ep.Program("silu")
    silu.store("y", ep.silu(silu.acc))
    rows, runs = [], {}
    for name, (m, n, k) in SHAPES.items():
        a, w, r, g = gemm_operands(m, n, k)
        z = a.float() @ w.float().t()
        runs[name, "plain", "cuBLAS"] = lambda a=a, w=w: torch.mm(a, w.t())
        for epilogue in EPILOGUES[name]:
            row = {"shape": name, "M x N x K": f"{m}x{n}x{k}", "epilogue": epilogue}
            if epilogue == "plain":
                runs[name, epilogue, "codetta"] = lambda a=a, w=w: codetta.gemm(a, w.t())
                want = z
            elif epilogue == "silu":
                runs[name, epilogue, "codetta"] = lambda a=a, w=w: codetta.gemm(a, w.t(), silu)
                want = z * torch.sigmoid(z)
            else:
                runs[name, epilogue, "codetta"] = lambda a=a, w=w, r=r, g=g: codetta.gemm(
                    a, w.t(), producer, residual=r, norm_weight=g)
                want = z + r.float()
            for variant in VARIANTS:
                c = run_probe(a, w, epilogue, variant, r, g)[0]
                err = ((c.float() - want).abs().max() / want.abs().max()).item()
                row[f"err {variant}"] = err
                if err < 1e-2:  # a wrong kernel is reported, not timed
                    runs[name, epilogue, variant] = (lambda a=a, w=w, e=epilogue, v=variant, r=r, g=g:
                                                     run_probe(a, w, e, v, r, g))
            rows.append(row)
    for run in runs.values():
        run()
    times = graph_ms_in_rounds(runs, args.rounds)
    median = {key: sorted(t)[args.rounds // 2] for key, t in times.items()}
    timed = ["codetta", *VARIANTS]
    for row in rows:
        cublas = median[row["shape"], "plain", "cuBLAS"]
        row["cuBLAS ms"] = cublas
        for what in timed:
            key = (row["shape"], row["epilogue"], what)
            if key in median:
                row[f"{what} / cuBLAS"] = median[key] / cublas
    columns = ["shape", "M x N x K", "epilogue", "cuBLAS ms", *(f"{what} / cuBLAS" for what in timed),
               *(f"err {variant}" for variant in VARIANTS)]
    table = markdown_table(rows, columns)
    print(table)
    write_results("autows_probe", rows, table + "\n\nTimes: CUDA-graph medians over shuffled rounds; each ratio is "
                  "to cuBLAS's plain GEMM of the shape (the speed of light of every epilogue). err: max |c - ref| / "
                  "max |ref| against fp32 PyTorch (x only for the residual epilogue); not timed above 1e-2.")


if __name__ == "__main__":
    main()
