"""codetta demo: codetta doing its work, on whatever device is present.

1. One fused GEMM+epilogue program (RMSNorm folded into a GEMM, SwiGLU in its epilogue),
   checked against PyTorch and, on a GPU, timed against cuBLAS.
2. A small Llama trained twice, as transformers builds it and patched by codetta: loss
   parity, throughput, and a PNG of both loss curves (codetta/demo.py).

On a machine without a CUDA GPU the real Triton kernels run in Triton's CPU interpreter
on small shapes; on a GPU they are compiled. The demo needs transformers, tqdm and
matplotlib (pip install "codetta[demo]").
"""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _program(ep):
    """The MLP input of a Llama block: z = rstd ⊙row (x W13^T); y = silu(z_gate) * z_up; stats of y."""
    p = ep.Program("demo_rmsnorm_swiglu")
    z = p.acc * p.row("rstd")
    gate, up = ep.pairs(z)  # gate/up rows interleaved in W13: columns (2j, 2j+1) pair up
    y = ep.silu(gate) * up
    p.store("z", z)
    p.store("y", y)
    p.row_sumsq("y_sumsq", y)
    return p


def _unfused(torch, x, w13, gamma, eps):
    """The same computation written the usual way in PyTorch (norm, GEMM, activation)."""
    h = torch.nn.functional.rms_norm(x, (x.shape[-1],), gamma, eps)
    z = h @ w13.t()
    y = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    return z, y, y.float().square().sum(-1)


def fused_program_check(args):
    import torch

    gpu = torch.cuda.is_available()
    import codetta
    from codetta import epilogue as ep

    dev = "cuda" if gpu else "cpu"
    m, d, f = (8192, 4096, 14336) if gpu else (96, 64, 80)
    dtype = torch.bfloat16
    print(f"codetta {codetta.__version__} demo on {torch.cuda.get_device_name() if gpu else 'CPU'}: "
          f"{'compiled Triton kernels' if gpu else 'Triton interpreter (no GPU here), small shapes'}")
    print(f"RMSNorm -> GEMM [{m} x {d}] @ [{d} x {2 * f}] -> SwiGLU, with the norm folded into the epilogue\n")
    torch.manual_seed(0)
    x = torch.randn(m, d, device=dev, dtype=dtype)
    gamma = (1 + 0.1 * torch.randn(d, device=dev)).to(dtype)
    w13 = (torch.randn(2 * f, d, device=dev) / d**0.5).to(dtype)
    eps = 1e-5

    program = _program(ep)
    if args.show_source:
        print(codetta.kernel_source(program, "tma"))

    # RMSNorm(x) W^T = rstd ⊙row ((x ⊙col gamma) W^T): the GEMM reads u = x * gamma,
    # its epilogue scales rows by rstd. Here two small passes make u and rstd; in a
    # patched block the epilogue of the GEMM before the norm writes them.
    def norm_inputs():
        return x * gamma, torch.rsqrt(x.float().square().mean(-1) + eps)

    def fused():
        u, rstd = norm_inputs()
        return codetta.gemm(u, w13.t(), program, rstd=rstd)

    out = fused()
    ref64 = _unfused(torch, x.double(), w13.double(), gamma.double(), eps)
    eager = _unfused(torch, x, w13, gamma, eps)
    print(f"{'output':10} {'codetta vs fp64':>16} {'eager bf16 vs fp64':>20}")
    for name, ours, theirs, ref in zip(("z", "y", "y_sumsq"), (out["z"], out["y"], out["y_sumsq"]), eager, ref64):
        e_ours = ((ours.double() - ref).norm() / ref.norm()).item()
        e_eager = ((theirs.double() - ref).norm() / ref.norm()).item()
        print(f"{name:10} {e_ours:16.2e} {e_eager:20.2e}")
        if not e_ours <= 2 * e_eager + 1e-6:
            print(f"FAILED: {name} is less accurate than twice eager PyTorch's error", file=sys.stderr)
            return 1
    if gpu:
        import statistics

        import triton

        u, rstd = norm_inputs()
        rows = (("cuBLAS GEMM alone (speed of light)", lambda: x @ w13.t()),
                ("codetta GEMM + epilogue", lambda: codetta.gemm(u, w13.t(), program, rstd=rstd)),
                ("  + the two passes making u, rstd", fused),
                ("eager PyTorch, unfused", lambda: _unfused(torch, x, w13, gamma, eps)))
        # Rounds over all variants in turn, each variant's median over them: a GPU that slows as it
        # warms under load would otherwise favour whichever variant ran first.
        rounds = [[triton.testing.do_bench(fn, return_mode="median") for _, fn in rows] for _ in range(5)]
        times = [statistics.median(column) for column in zip(*rounds)]
        print(f"\n{'variant':34} {'ms':>8} {'vs cuBLAS GEMM':>15}")
        for (name, _), t in zip(rows, times):
            print(f"{name:34} {t:8.3f} {t / times[0]:14.2f}x")
    print("\nok: fused results match PyTorch within bf16 precision")
    return 0


def demo(args):
    from . import demo as training_demo

    return fused_program_check(args) or training_demo.run(args.out, steps=args.steps)


MIN_STEPS = 10


def _steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the number of steps must be an integer, got {text!r}") from None
    if steps < MIN_STEPS:
        raise argparse.ArgumentTypeError(f"at least {MIN_STEPS} steps (the parity check compares the runs' last "
                                         f"tenth, after they have learned something), got {steps}")
    return steps


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _plot_path(text: str):
    """The plot's file, checked before the training: a writable folder, a file name with an image suffix."""
    from pathlib import Path

    path = Path(text).expanduser()
    if not text:
        raise argparse.ArgumentTypeError("the plot's file name is empty (e.g. loss.png)")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file name for the plot (e.g. loss.png)")
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"the plot's file name must end in one of {', '.join(PLOT_SUFFIXES)}, "
                                         f"got {text!r}")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{folder} is not a folder (the plot is written after the training)")
    existed = path.exists()
    try:  # a test write now, not a permission guess: the plot comes after minutes of training
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{path} cannot be written ({exc.strerror}); the plot is written after "
                                         "the training") from None
    if not existed:
        path.unlink()
    return path.resolve()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="codetta", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"codetta {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="check a fused GEMM+epilogue program (timed on a GPU), then train a small "
                                    "Llama plain and patched: loss parity, throughput, a plot")
    d.add_argument("--show-source", action="store_true", help="print the generated Triton kernel")
    d.add_argument("--out", type=_plot_path, default="codetta_demo_loss.png",
                   help="where to write the loss-curve plot")
    d.add_argument("--steps", type=_steps, default=None, help=f"training steps, at least {MIN_STEPS} (default: by device)")
    missing = _missing_extras()
    args = parser.parse_args(argv)
    if missing:
        print(f"codetta demo needs {', '.join(missing)}: pip install \"codetta[demo]\"", file=sys.stderr)
        return 2
    return demo(args)


def _missing_extras() -> list[str]:
    from importlib.util import find_spec

    return [name for name in ("transformers", "tqdm", "matplotlib") if find_spec(name) is None]


if __name__ == "__main__":
    sys.exit(main())
