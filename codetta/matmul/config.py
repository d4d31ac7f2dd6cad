"""Tile configurations of the mainloop, and which of them fit a problem."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Config:
    """One launch configuration: tile sizes, tile-order grouping, pipeline depth, warps.

    FLATTEN: compile the persistent tile loop and the K loop as one flattened loop
    (``tl.range(..., flatten=True)``), so that the loads of a tile's first K blocks are in
    flight while the previous tile's epilogue runs. It applies to a B of one part through
    TMA descriptors, or two interleaved through one (the launcher ignores it otherwise).

    CTAS_PER_SM: programs of the persistent grid per SM. With 2, two CTAs share an SM and
    the warp schedulers interleave them: one runs its epilogue (memory traffic, no MMAs)
    while the other's mainloop keeps the tensor cores busy, a ping-pong schedule without
    warp specialization. Each CTA then gets half of the SM's shared memory and registers
    (with 8 warps a cap of 128 registers a thread: see :meth:`launch_options`).
    """

    BM: int
    BN: int
    BK: int
    GROUP_M: int = 8
    STAGES: int = 3
    num_warps: int = 8
    EPI_SPLIT: int = 1  # run the epilogue on 1, 2 or 4 column slices of the tile
    FLATTEN: bool = False
    CTAS_PER_SM: int = 1

    def __post_init__(self):
        def power_of_two(name, low, high):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low or v > high or v & (v - 1):
                raise ValueError(f"Config.{name} must be a power of two in [{low}, {high}], got {v!r}")

        for name in ("BM", "BN", "BK"):
            power_of_two(name, 16, 1 << 16)
        power_of_two("num_warps", 1, 32)
        power_of_two("EPI_SPLIT", 1, 4)
        for name in ("GROUP_M", "STAGES", "CTAS_PER_SM"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Config.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.FLATTEN, bool):
            raise ValueError(f"Config.FLATTEN must be a bool, got {self.FLATTEN!r}")

    @property
    def epilogue_bn(self):
        """The width of the tiles the epilogue program sees."""
        return self.BN // self.EPI_SPLIT

    def as_dict(self):
        """The config's fields by name (how tuning.json stores it)."""
        return asdict(self)

    def launch_options(self) -> dict:
        """Triton's launch options: warps, pipeline stages and, when CTAS_PER_SM CTAs could not
        otherwise share the SM's 64K registers, a cap on registers per thread (``maxnreg``)."""
        options = dict(num_warps=self.num_warps, num_stages=self.STAGES)
        per_thread = _REGISTERS_PER_SM // (self.CTAS_PER_SM * self.num_warps * 32)
        if per_thread < _MAX_REGISTERS_PER_THREAD:
            options["maxnreg"] = per_thread
        return options

    def smem_bytes(self, elem_bytes: int, staged_bytes: int | None = None, aux_bytes: int = 0) -> int:
        """Shared memory of the operand ring plus the epilogue's staging.

        ``elem_bytes``: the size of an A/B element. The epilogue stages one output slice
        [BM, epilogue_bn] of its widest stored or loaded tile (``staged_bytes`` per element;
        default: ``elem_bytes``); a flattened loop also prefetches each aux tile
        (``aux_bytes``: their summed element sizes). Measured with Triton 3.6 on the H200:
        128x256x64, 3 stages needs 272 KiB with an fp32 output, or flattened with a bf16
        aux tile (over the 227 KiB there), 208 KiB otherwise.
        """
        slice_ = self.BM * self.epilogue_bn
        staging = slice_ * (staged_bytes or elem_bytes) + (slice_ * aux_bytes if self.FLATTEN else 0)
        return self.STAGES * (self.BM + self.BN) * self.BK * elem_bytes + staging


# Hopper candidates for 16-bit inputs (BM, BN, BK, GROUP_M, STAGES, num_warps, EPI_SPLIT).
# No warp specialization: Triton 3.6 fails on several epilogues with it and aborts the
# process on one (see docs/internals.md).
_HOPPER_16 = [
    (128, 256, 64, 8, 3, 8, 1),
    (128, 256, 64, 8, 3, 8, 2),
    (128, 256, 64, 8, 4, 8, 2),
    (128, 256, 64, 8, 3, 8, 4),  # quarters: fewer spills in heavy epilogues, room for a 4th stage
    (128, 256, 64, 8, 4, 8, 4),
    (256, 128, 64, 8, 3, 8, 1),
    (256, 128, 64, 8, 4, 8, 2),
    (128, 128, 64, 8, 4, 8, 1),
    (128, 128, 64, 8, 5, 4, 1),
    (64, 256, 64, 8, 4, 4, 1),
    (64, 128, 64, 8, 4, 4, 1),
]
# Two CTAs per SM (see Config): half the shared memory and registers each.
_HOPPER_16_TWO_PER_SM = [
    (128, 128, 64, 8, 2, 4, 1),
    (128, 128, 64, 8, 3, 4, 2),
    (128, 128, 64, 8, 2, 8, 1),
    (128, 128, 64, 8, 3, 8, 2),
]
_HOPPER_32 = [
    (128, 128, 32, 8, 3, 8, 1),
    (128, 64, 32, 8, 4, 4, 1),
    (64, 128, 32, 8, 4, 4, 1),
    (64, 64, 32, 8, 4, 4, 1),
]
WIDEST_BN = max(row[1] for row in _HOPPER_16 + _HOPPER_16_TWO_PER_SM + _HOPPER_32)  # the widest tile tried
# The last resorts where none of the above fits a GPU's shared memory, or the program's segments
# widen the tiles past it (40 KiB with 16-bit inputs at 64 x 64 x 64; a 1024-column segment fits
# with BK = 16): the first that fits.
_SMALLEST = {2: [(64, 64, bk, 8, 2, 4, 1) for bk in (64, 32, 16)], 4: [(64, 64, bk, 8, 2, 4, 1) for bk in (32, 16)]}
_REGISTERS_PER_SM = 65536
_MAX_REGISTERS_PER_THREAD = 255
_FLATTENED = 4  # how many of the best-guess configs are also tried with a flattened loop


@dataclass(frozen=True)
class SharedMemory:
    """A GPU's shared memory: per SM, and the most one CTA may use (default: H100 and H200)."""

    per_sm: int = 228 * 1024
    per_block: int = 227 * 1024

    def limit(self, ctas_per_sm: int = 1) -> int:
        """What one CTA may use when ``ctas_per_sm`` CTAs share an SM (1 KiB each is reserved)."""
        return min(self.per_block, self.per_sm // ctas_per_sm - 1024)


HOPPER = SharedMemory()


def tiles_parts(block_n: int, part_sizes) -> bool:
    """Whether tiles ``block_n`` wide end where each B part along N ends (all parts but the last
    are ``part_sizes``): a tile then reads one part, through its own descriptor."""
    return not any(size % block_n for size in part_sizes)


def candidates(*, elem_bytes: int, min_bn: int, n_parts_sizes=(), m: int = 0, n: int = 0, flatten: bool = False,
               staged_bytes: int | None = None, aux_bytes: int = 0, smem: SharedMemory = HOPPER):
    """The configs worth trying on a GPU, best guess first.

    ``min_bn``: the smallest tile width the program's epilogue needs (segments fit whole);
    ``n_parts_sizes``: sizes along N of all B parts but the last (on the TMA path a tile
    must not straddle them; the caller passes () for the pointer path). Configs whose
    tiles are far larger than the problem are dropped (all but the smallest, if need be).
    ``flatten``: also try the first few with a flattened loop (see :class:`Config`), after
    all the others, so that the first candidate (taken untuned) stays the same.
    ``staged_bytes``, ``aux_bytes``: the epilogue's shared memory (see :meth:`Config.smem_bytes`);
    ``smem``: the GPU's. Where none of the tuned tables fits it, one small config (the deepest
    ``BK`` that fits).
    """
    def fits(cfg):
        return cfg.smem_bytes(elem_bytes, staged_bytes, aux_bytes) <= smem.limit(cfg.CTAS_PER_SM)

    def admissible(rows):
        """(the configs of ``rows`` that fit, those whose tiles are far larger than the problem)."""
        fitting, small = [], []
        for (bm, bn, bk, group, stages, warps, split), per_sm in rows:
            if bn // split < min_bn:
                if split > 1:
                    continue
                bn = min_bn
            cfg = Config(bm, bn, bk, group, stages, warps, split, CTAS_PER_SM=per_sm)
            if cfg in fitting + small or not fits(cfg):
                continue
            if not tiles_parts(cfg.BN, n_parts_sizes):
                continue
            oversized = (m and m <= bm // 2 and bm > 64) or (n and n <= bn // 2 and bn > max(64, min_bn))
            (small if oversized else fitting).append(cfg)
        return fitting, small

    if elem_bytes <= 2:
        table = [(t, 1) for t in _HOPPER_16] + [(t, 2) for t in _HOPPER_16_TWO_PER_SM]
    else:
        table = [(t, 1) for t in _HOPPER_32]
    fitting, small = admissible(table)
    for last_resort in _SMALLEST[2 if elem_bytes <= 2 else 4]:
        if fitting or small:
            break
        fitting, small = admissible([(last_resort, 1)])
    # A tiny problem keeps the smallest tiles rather than nothing.
    chosen = fitting or sorted(small, key=lambda c: (c.BM * c.BN, c.STAGES))[:1]
    if flatten:
        flattened = [replace(cfg, FLATTEN=True) for cfg in chosen[:_FLATTENED]]
        chosen = chosen + [cfg for cfg in flattened if fits(cfg)]
    return chosen


# In Triton's CPU interpreter, GEMM dims (M, N, K) up to this size count as small.
INTERPRETER_SMALL_DIM = 128


def interpreter_config(*, min_bn: int, n_parts_sizes=(), m: int = 0, n: int = 0, k: int = 0):
    """A config for Triton's CPU interpreter, which pays per operation more than per element.

    Small problems (tests) get 16-wide tiles, so that they still span several tiles and
    exercise the persistent loop and the masks; larger ones (the demo) 64-wide tiles.
    Small means at most ``INTERPRETER_SMALL_DIM`` along that dim. None when no tile width
    both holds the program's segments and divides the B parts.
    """
    small = INTERPRETER_SMALL_DIM
    bm = 16 if m <= small else 64
    bn = max(16 if n <= small else 64, min_bn)
    if not tiles_parts(bn, n_parts_sizes):
        bn = max(16, min_bn)
        if not tiles_parts(bn, n_parts_sizes):
            return None
    return Config(BM=bm, BN=bn, BK=16 if k <= small else 32, GROUP_M=2, STAGES=1, num_warps=4)
