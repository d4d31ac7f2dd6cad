"""Quick compiled-kernel check on a GPU: a few programs on both paths against fp64 references."""
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import codetta  # noqa: E402
from codetta import epilogue as ep  # noqa: E402

from common import require_gpu  # noqa: E402

require_gpu("device_smoke")

dev = "cuda"
p = ep.Program("smoke_all")
z = p.acc * p.row("rstd")
g, u = ep.pairs(z)
p.store("z", z)
p.store("y", ep.silu(g) * u)
p.row_sumsq("ss", z)
p.row_logsumexp("lse", z)
p.col_sum("cs", z * p.aux("res"))
p.row_sum("hs", z, segment=128)
p2 = ep.Program("smoke_rot")
f, s = ep.pairs(p2.acc, segment=128)
c, sn = p2.col("c", ep.HALF), p2.col("s", ep.HALF)
p2.store("o", ep.join(f * c - s * sn, s * c + f * sn, segment=128))
for path in ("tma", "ptr"):
    os.environ["CODETTA_PATH"] = path
    for dtype in (torch.float32, torch.bfloat16):
        for M, N, K in ((300, 512, 200), (1000, 768, 1024)):
            a = torch.randn(M, K, device=dev, dtype=dtype)
            b = torch.randn(N, K, device=dev, dtype=dtype)
            ops = dict(rstd=torch.rand(M, device=dev), res=torch.randn(M, N, device=dev))
            t = time.time()
            out = codetta.gemm(a, b.t(), p, **ops)
            torch.cuda.synchronize()
            ref = ep.run_reference(p, a.double(), b.t().double(), {k: v.double() for k, v in ops.items()}, torch.float64)
            errs = {k: ((out[k].double() - ref[k]).norm() / ref[k].norm()).item() for k in out}
            print(path, dtype, (M, N, K), f"{time.time() - t:.1f}s", {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
            b1, b2 = torch.randn(K, 256, device=dev, dtype=dtype), torch.randn(K, 512, device=dev, dtype=dtype)
            ops2 = dict(c=torch.rand(384, device=dev), s=torch.rand(384, device=dev))
            out = codetta.gemm(a, [b1, b2], p2, **ops2)
            ref = ep.run_reference(p2, a.double(), [b1.double(), b2.double()], {k: v.double() for k, v in ops2.items()}, torch.float64)
            print("  rot+parts", ((out["o"].double() - ref["o"]).norm() / ref["o"].norm()).item(), flush=True)
            for name, aa, bb in (("dgrad", a, b), ("wgrad", a.t(), a)):
                if name == "dgrad":
                    bb = torch.randn(K, 256, device=dev, dtype=dtype)
                o = codetta.gemm(aa, bb)
                r = aa.double() @ bb.double()
                print("  ", name, ((o.double() - r).norm() / r.norm()).item(), flush=True)
