"""Autotuning picks the fastest config, writes it to disk, and a second process reuses it."""

import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from unittest import mock

import pytest
import torch

import codetta
from codetta.matmul import launch, plan, tuning
from codetta.matmul.call import Call
from codetta.matmul.config import HOPPER, Config, SharedMemory, candidates
from codetta.matmul.path import layouts
from conftest import DEVICE


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CODETTA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CODETTA_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "_MEMORY", {})
    return tmp_path


CONFIGS = [Config(128, 256, 64), Config(128, 128, 64, STAGES=4), Config(64, 128, 64, num_warps=4)]


def test_fastest_config_wins_and_is_written(cache_dir):
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}
    assert tuning.choose("k1", CONFIGS, times.__getitem__) == CONFIGS[1]
    table = json.loads((cache_dir / "tuning.json").read_text())
    assert [Config(**v) for v in table.values()] == [CONFIGS[1]]


def test_every_candidates_time_is_logged_when_asked(cache_dir, monkeypatch):
    log = cache_dir / "tune.log"
    monkeypatch.setenv("CODETTA_TUNE_LOG", str(log))
    times = {CONFIGS[0]: 1.1, CONFIGS[1]: 1.0, CONFIGS[2]: 1.05}
    tuning.choose("logged", CONFIGS, times.__getitem__)
    (entry,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert entry["key"].startswith("logged|") and Config(**entry["best"]) == CONFIGS[1]
    assert [(t, Config(**c)) for t, c in entry["ms"]] == [(1.0, CONFIGS[1]), (1.05, CONFIGS[2]), (1.1, CONFIGS[0])]


def test_each_tuning_is_logged_at_info_level_and_a_cached_choice_is_not(cache_dir, caplog):
    """The logger "codetta" tells at INFO level what was tuned, over how many candidates, and
    what won (a first step can spend tens of seconds tuning); a choice read from the cache is silent."""
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}
    with caplog.at_level(logging.INFO, logger="codetta"):
        tuning.choose("told", CONFIGS, times.__getitem__)
        tuning.choose("told", CONFIGS, times.__getitem__)
    (record,) = caplog.records
    assert record.name == "codetta" and record.levelno == logging.INFO
    assert record.getMessage().startswith("codetta: tuned told|")
    assert f"over 3 candidates: {CONFIGS[1]}, 1.0000 ms" in record.getMessage()


def test_a_gpu_faster_while_it_starts_does_not_favour_the_first_candidate(cache_dir):
    """Timed from idle, a GPU runs its first timings at boost clocks (10% faster here): the
    first candidate, 5% slower than the second, must not win for it (each is timed in three
    rounds of shuffled order, and the median counts)."""
    calls = []

    def bench(cfg):
        calls.append(cfg)
        speed = 0.9 if len(calls) <= 2 else 1.0
        return speed * {CONFIGS[0]: 1.05, CONFIGS[1]: 1.0, CONFIGS[2]: 1.2}[cfg]

    assert tuning.choose("boost", CONFIGS, bench) == CONFIGS[1]
    assert calls.count(CONFIGS[1]) == tuning._ROUNDS


def test_failing_configs_are_skipped(cache_dir):
    def bench(cfg):
        if cfg is not CONFIGS[2]:
            raise RuntimeError("out of resources")
        return 1.0

    assert tuning.choose("k2", CONFIGS, bench) == CONFIGS[2]


@pytest.mark.parametrize("contents", ["[1, 2]", "null", '"text"', '{"KEY": 5}', '{"KEY": {"BM": 64}}',
                                      '{"KEY": {"BM": 64, "BN": 64, "BK": 32, "COLOUR": 1}}', "[" * 100_000])
def test_a_damaged_cache_file_is_tuned_over(cache_dir, contents):
    """A tuning.json that is no table, or whose entry is no config: timed again, and rewritten."""
    key = "k_damaged"
    hashed = tuning.cache_key(key, CONFIGS)
    (cache_dir / "tuning.json").write_text(contents.replace("KEY", hashed))
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 2.0, CONFIGS[2]: 1.0}
    assert tuning.choose(key, CONFIGS, times.__getitem__) == CONFIGS[2]
    assert Config(**json.loads((cache_dir / "tuning.json").read_text())[hashed]) == CONFIGS[2]


def test_an_unwritable_tuning_log_warns_and_the_choice_is_kept(cache_dir, monkeypatch):
    monkeypatch.setenv("CODETTA_TUNE_LOG", str(cache_dir / "no_such_folder" / "tune.log"))
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}
    with pytest.warns(UserWarning, match="cannot append to CODETTA_TUNE_LOG"):
        assert tuning.choose("k_log", CONFIGS, times.__getitem__) == CONFIGS[1]
    assert tuning.choose("k_log", CONFIGS, lambda cfg: pytest.fail("timed again")) == CONFIGS[1]
    assert len(json.loads((cache_dir / "tuning.json").read_text())) == 1


def test_a_cache_file_that_cannot_be_read_is_not_written_over(cache_dir, monkeypatch):
    """Another user's tuning.json (or one an I/O error hides) is left as it is, with a warning;
    merged into an empty table and replaced, its entries would be lost."""
    file = cache_dir / "tuning.json"
    file.write_text(json.dumps({"theirs": CONFIGS[0].as_dict()}))
    read_text = type(file).read_text

    def unreadable(path, *args, **kwargs):
        if path == file:
            raise PermissionError(13, "Permission denied", str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(type(file), "read_text", unreadable)
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}
    with pytest.warns(UserWarning, match="cannot write the tuning cache .*Permission denied"):
        assert tuning.choose("mine", CONFIGS, times.__getitem__) == CONFIGS[1]
    monkeypatch.undo()
    assert json.loads(file.read_text()) == {"theirs": CONFIGS[0].as_dict()}


def test_the_cache_file_is_as_readable_as_the_umask_lets_new_files_be(cache_dir):
    """Shared by the users of one machine (CODETTA_CACHE_DIR on a common folder), the file is
    written with the permissions of a newly opened file, not a temporary file's owner-only ones,
    and a failed write leaves no temporary file beside it."""
    old = os.umask(0o022)
    try:
        tuning._save("k_mode", CONFIGS[0].as_dict())
    finally:
        os.umask(old)
    assert stat.S_IMODE((cache_dir / "tuning.json").stat().st_mode) == 0o644
    with mock.patch("os.replace", side_effect=OSError(28, "No space left on device")), \
            pytest.warns(UserWarning, match="No space left"):
        tuning._save("k_full", CONFIGS[1].as_dict())
    assert sorted(p.name for p in cache_dir.iterdir()) == ["tuning.json", "tuning.json.lock"]


def test_each_cache_folder_has_its_own_table(tmp_path, monkeypatch):
    """A process that moves CODETTA_CACHE_DIR reads the choices made there, not those it knows
    from the folder before; ``~`` in it is the home folder."""
    monkeypatch.setattr(tuning, "_MEMORY", {})
    monkeypatch.setenv("CODETTA_AUTOTUNE", "1")
    for folder, fastest in ((tmp_path / "one", CONFIGS[1]), (tmp_path / "two", CONFIGS[2])):
        monkeypatch.setenv("CODETTA_CACHE_DIR", str(folder))
        times = {cfg: 1.0 if cfg == fastest else 2.0 for cfg in CONFIGS}
        assert tuning.choose("k_moved", CONFIGS, times.__getitem__) == fastest
    monkeypatch.setenv("CODETTA_CACHE_DIR", str(tmp_path / "one"))
    assert tuning.choose("k_moved", CONFIGS, lambda cfg: pytest.fail("timed again")) == CONFIGS[1]
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CODETTA_CACHE_DIR", "~/three")
    assert tuning.cache_file() == tmp_path / "three" / "tuning.json"


def test_entries_written_by_another_process_meanwhile_are_kept(cache_dir):
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}
    tuning.choose("mine_1", CONFIGS, times.__getitem__)  # this process has read and written the file
    table = json.loads((cache_dir / "tuning.json").read_text())
    table["theirs"] = CONFIGS[0].as_dict()  # another process adds an entry
    (cache_dir / "tuning.json").write_text(json.dumps(table))
    tuning.choose("mine_2", CONFIGS, times.__getitem__)
    keys = json.loads((cache_dir / "tuning.json").read_text()).keys()
    assert "theirs" in keys and sum(k.startswith("mine_") for k in keys) == 2


def test_two_processes_saving_at_once_keep_every_entry(cache_dir):
    """Processes tuning at the same time (DDP ranks) each read, merge and replace the file: a lock
    between them keeps every entry (without it the last writer dropped the other's new ones)."""
    code = (
        "import sys, time\n"
        "from codetta.matmul import tuning\n"
        "tag, start = sys.argv[1], float(sys.argv[2])\n"
        "time.sleep(max(0.0, start - time.time()))\n"
        "for i in range(60):\n"
        "    tuning._save(f'{tag}-{i}', {'BM': 16, 'BN': 16, 'BK': 16})\n"
    )
    env = {"CODETTA_CACHE_DIR": str(cache_dir), "PATH": "", "TRITON_INTERPRET": "1"}
    start = str(time.time() + 8)  # both processes have imported codetta by then
    runs = [subprocess.Popen([sys.executable, "-c", code, tag, start], env=env, stderr=subprocess.PIPE, text=True)
            for tag in ("A", "B")]
    for run in runs:
        assert run.wait(timeout=120) == 0, run.stderr.read()
    keys = json.loads((cache_dir / "tuning.json").read_text()).keys()
    assert sorted(keys) == sorted(f"{tag}-{i}" for tag in ("A", "B") for i in range(60))


def test_an_unwritable_cache_keeps_the_choice_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("CODETTA_CACHE_DIR", str(blocker))  # not a folder: nothing can be written under it
    monkeypatch.setenv("CODETTA_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "_MEMORY", {})
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}
    with pytest.warns(UserWarning, match="cannot write the tuning cache"):
        assert tuning.choose("k_ro", CONFIGS, times.__getitem__) == CONFIGS[1]
    assert tuning.choose("k_ro", CONFIGS, lambda cfg: pytest.fail("timed again")) == CONFIGS[1]


def test_second_process_does_not_retune(cache_dir):
    tuning.choose("shared-key", CONFIGS, {CONFIGS[0]: 2.0, CONFIGS[1]: 3.0, CONFIGS[2]: 1.0}.__getitem__)
    code = (
        "from codetta.matmul import tuning; from codetta.matmul.config import Config\n"
        f"configs = {CONFIGS!r}\n"
        "def bench(cfg): raise SystemExit('re-tuned')\n"
        "print(tuning.choose('shared-key', configs, bench))\n"
    )
    env = {"CODETTA_CACHE_DIR": str(cache_dir), "PATH": "", "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(CONFIGS[2])


def test_candidates_are_prepared_once_before_timing(cache_dir):
    """prepare (the parallel compile) sees every candidate before the first timing, and not at all
    when the choice is cached."""
    events = []

    def bench(cfg):
        events.append(("time", cfg))
        return {CONFIGS[0]: 2.0, CONFIGS[1]: 1.0, CONFIGS[2]: 3.0}[cfg]

    def prepare(cfgs):
        events.append(("prepare", tuple(cfgs)))

    assert tuning.choose("k5", CONFIGS, bench, prepare=prepare) == CONFIGS[1]
    timed = [cfg for kind, cfg in events[1:] if kind == "time"]
    assert events[0] == ("prepare", tuple(CONFIGS)) and len(timed) == len(events) - 1
    assert sorted(map(timed.count, CONFIGS)) == [1, 1, tuning._ROUNDS]  # the others are 2x and 3x the best
    events.clear()
    assert tuning.choose("k5", CONFIGS, bench, prepare=prepare) == CONFIGS[1]
    assert events == []


@pytest.mark.parametrize("written", ["aux_in_place", "accumulated_column_block"])
def test_timed_launches_leave_what_the_kernel_reads_and_writes(cache_dir, monkeypatch, written):
    """The tuner times its candidates on the call's own tensors. One the kernel reads and writes (an
    aux operand given as its own out=, a tensor accumulated into, here a column block of a wider
    buffer on the pointer path) holds its values again after the timings: the call then gives
    x + acc, not x + acc once per timed launch."""
    from codetta import epilogue as ep

    monkeypatch.setattr(tuning, "graph_ms", lambda fn: (fn(), fn(), 1.0)[-1])
    m, n, k = 24, 40, 8
    a, b = torch.randn(m, k, device=DEVICE), torch.randn(k, n, device=DEVICE)
    p = ep.Program(f"tuned_{written}")
    buffer = torch.randn(m, n + 3, device=DEVICE)
    if written == "aux_in_place":
        p.store("y", p.aux("x") + p.acc, dtype=torch.float32)
        x = buffer[:, :n].contiguous()
        operands, out = {"x": x}, {"y": x}
    else:
        p.store("x", p.acc, accumulate=True, dtype=torch.float32)
        x = buffer[:, 1 : n + 1]
        operands, out = {"x": x}, {}
    before = buffer.clone(), x.clone()
    call = Call(a, b, p, operands, out)
    call.layout = layouts(call)
    configs = [Config(16, 16, 16), Config(32, 32, 16)]
    assert launch._tuned(call, "ptr", configs) in configs
    assert torch.equal(x, before[1])
    if written != "aux_in_place":
        assert torch.equal(buffer, before[0])
    # the whole call, tuned afresh (on a GPU; the interpreter has one candidate): x + acc, once
    monkeypatch.setenv("CODETTA_CACHE_DIR", str(cache_dir / "fresh"))
    monkeypatch.setattr(tuning, "_MEMORY", {})
    result = codetta.gemm(a, b, p, out=out, **operands)[next(iter(p.outputs))]
    expected = before[1].double() + a.double() @ b.double()
    torch.testing.assert_close(result.double(), expected, rtol=2e-3, atol=2e-3)  # tf32 on a GPU


def test_compile_in_parallel_runs_every_compile_and_survives_failures():
    seen = []

    def compile_one(i):
        if i == 2:
            raise RuntimeError("does not compile")
        seen.append(i)

    tuning.compile_in_parallel([lambda i=i: compile_one(i) for i in range(5)])
    assert sorted(seen) == [0, 1, 3, 4]
    tuning.compile_in_parallel([])  # nothing to do


def test_new_candidate_list_retunes(cache_dir):
    tuning.choose("k3", CONFIGS, {CONFIGS[0]: 2.0, CONFIGS[1]: 3.0, CONFIGS[2]: 1.0}.__getitem__)
    fewer = CONFIGS[:2]
    assert tuning.choose("k3", fewer, {CONFIGS[0]: 2.0, CONFIGS[1]: 1.0}.__getitem__) == CONFIGS[1]


def test_a_choice_timed_another_way_is_timed_again(cache_dir):
    """An entry under the key of an older way of timing (do_bench's, before graph replay) is not
    taken: the candidates are timed again, and the new choice written beside it."""
    old = "k_old|" + hashlib.sha256(repr(CONFIGS).encode()).hexdigest()[:8]
    (cache_dir / "tuning.json").write_text(json.dumps({old: CONFIGS[0].as_dict()}))
    assert tuning.choose("k_old", CONFIGS, {CONFIGS[0]: 3.0, CONFIGS[1]: 2.0, CONFIGS[2]: 1.0}.__getitem__) == CONFIGS[2]
    table = json.loads((cache_dir / "tuning.json").read_text())
    assert Config(**table[tuning.cache_key("k_old", CONFIGS)]) == CONFIGS[2] and old in table


@pytest.mark.parametrize("value", ["0", "false", "No", " off "])
def test_autotune_off_takes_first(cache_dir, monkeypatch, value):
    monkeypatch.setenv("CODETTA_AUTOTUNE", value)
    assert tuning.choose("k4", CONFIGS, lambda cfg: pytest.fail("timed a config")) == CONFIGS[0]


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_an_autotune_setting_neither_on_nor_off_is_refused(cache_dir, monkeypatch, value):
    monkeypatch.setenv("CODETTA_AUTOTUNE", value)
    with pytest.raises(ValueError, match=f"CODETTA_AUTOTUNE={value!r}: expected 1 or 0"):
        tuning.choose("k5", CONFIGS, lambda cfg: 1.0)


def test_a_bad_autotune_setting_is_refused_by_any_gemm(monkeypatch):
    """Also where the call would not tune (on the CPU, with a config given): a setting that works
    here fails nowhere else."""
    monkeypatch.setenv("CODETTA_AUTOTUNE", "banana")
    a, b = torch.randn(5, 3, device=DEVICE), torch.randn(3, 7, device=DEVICE)
    with pytest.raises(ValueError, match="CODETTA_AUTOTUNE='banana': expected 1 or 0"):
        codetta.gemm(a, b, config=Config(BM=64, BN=64, BK=32))


def test_candidates_respect_program_and_parts():
    """Tiles hold the program's segments whole and never straddle B parts (TMA path)."""
    for cfg in candidates(elem_bytes=2, min_bn=256, n_parts_sizes=(4096, 1024)):
        assert cfg.epilogue_bn >= 256 and 4096 % cfg.BN == 0 and 1024 % cfg.BN == 0
    assert all(c.BK == 32 for c in candidates(elem_bytes=4, min_bn=1))
    assert candidates(elem_bytes=2, min_bn=1, n_parts_sizes=(100,)) == []


@pytest.mark.parametrize("elem_bytes, staged, min_bn", [(2, 4, 512), (4, None, 512), (2, None, 1024)])
def test_segments_wider_than_the_tables_get_a_config_that_fits(elem_bytes, staged, min_bn):
    """A segment wider than every tuned tile widens the tile; the tables' K steps then overflow
    shared memory, and a last resort with a shallower one (BK 32 or 16) takes their place."""
    found = candidates(elem_bytes=elem_bytes, min_bn=min_bn, m=4096, n=4096, staged_bytes=staged)
    assert found
    for cfg in found:
        assert cfg.epilogue_bn >= min_bn and cfg.smem_bytes(elem_bytes, staged) <= HOPPER.limit(cfg.CTAS_PER_SM)


def test_flattened_candidates_come_last():
    """Flattened-loop variants of the first configs are appended: the untuned first choice is unchanged."""
    plain = candidates(elem_bytes=2, min_bn=2, m=4096, n=4096)
    both = candidates(elem_bytes=2, min_bn=2, m=4096, n=4096, flatten=True)
    assert both[: len(plain)] == plain and not any(c.FLATTEN for c in plain)
    extra = both[len(plain):]
    assert extra and all(c.FLATTEN for c in extra)
    assert {replace(c, FLATTEN=False) for c in extra} <= set(plain[:4])


def test_epilogue_shared_memory_limits_the_configs():
    """The epilogue stages one output slice of its widest tile, and a flattened loop prefetches
    its aux tiles too: 128x256x64 with 3 stages needs 272 KiB (over the H200's 227 KiB, where
    Triton refused it) with an fp32 output, or flattened with a bf16 aux tile."""
    cfg = Config(BM=128, BN=256, BK=64, STAGES=3)
    flat = replace(cfg, FLATTEN=True)
    assert cfg.smem_bytes(2) == flat.smem_bytes(2) == 208 * 1024
    assert cfg.smem_bytes(2, staged_bytes=4) == flat.smem_bytes(2, aux_bytes=2) == 272 * 1024
    assert cfg.smem_bytes(2, aux_bytes=2) == 208 * 1024  # no prefetch without flattening
    size = dict(elem_bytes=2, min_bn=2, m=4096, n=4096, flatten=True)
    assert cfg in candidates(**size) and flat in candidates(**size)
    assert flat not in candidates(**size, aux_bytes=2) and cfg in candidates(**size, aux_bytes=2)
    fp32_out = candidates(**size, staged_bytes=4)
    assert cfg not in fp32_out and all(c.smem_bytes(2, 4) <= 227 * 1024 for c in fp32_out)


def test_two_ctas_per_sm_candidates_fit_half_an_sm():
    """Configs that share an SM between two CTAs (one's epilogue overlapping the other's MMAs)
    come after the one-per-SM ones and use at most half the SM's shared memory."""
    size = dict(elem_bytes=2, min_bn=2, m=8192, n=8192)
    found = candidates(**size)
    pairs = [c for c in found if c.CTAS_PER_SM == 2]
    assert pairs and found[0].CTAS_PER_SM == 1
    assert found.index(pairs[0]) > max(i for i, c in enumerate(found) if c.CTAS_PER_SM == 1)
    for staged in (None, 4):
        for cfg in candidates(**size, staged_bytes=staged):
            assert cfg.smem_bytes(2, staged) <= HOPPER.limit(cfg.CTAS_PER_SM)
            assert cfg.CTAS_PER_SM == 1 or cfg.smem_bytes(2, staged) <= 113 * 1024
    assert HOPPER.limit(1) == 227 * 1024 and HOPPER.limit(2) == 113 * 1024
    assert not any(c.CTAS_PER_SM == 2 for c in candidates(elem_bytes=4, min_bn=1))


def test_persistent_grid_has_a_program_per_cta(monkeypatch):
    """On a GPU the grid holds CTAS_PER_SM programs per SM, never more than there are tiles."""
    monkeypatch.setattr(plan, "interpreting", lambda: False)
    monkeypatch.setattr(plan, "_sm_count", lambda index: 132)
    device = torch.device("cuda", 0)
    assert plan.num_programs(device, 10_000) == 132
    assert plan.num_programs(device, 10_000, 2) == 264
    assert plan.num_programs(device, 200, 2) == 200


def test_two_ctas_per_sm_cap_registers_when_they_must():
    """Two CTAs share an SM's 64K registers: 8 warps get at most 128 a thread; 4 warps fit anyway."""
    one = Config(128, 256, 64, num_warps=8)
    assert one.launch_options() == dict(num_warps=8, num_stages=3)
    assert replace(one, BN=128, CTAS_PER_SM=2).launch_options() == dict(num_warps=8, num_stages=3, maxnreg=128)
    assert "maxnreg" not in replace(one, BN=128, num_warps=4, CTAS_PER_SM=2).launch_options()


@pytest.mark.parametrize("per_sm, per_block", [(164 * 1024, 163 * 1024), (100 * 1024, 99 * 1024), (64 * 1024, 64 * 1024)])
def test_candidates_fit_the_gpus_shared_memory(per_sm, per_block):
    """A GPU with less shared memory than Hopper (A100: 164 KiB per SM; consumer Ampere: 100 KiB;
    Turing: 64 KiB) gets only configs that fit it, and at least one (the untuned first choice
    must launch)."""
    smem = SharedMemory(per_sm, per_block)
    for elem_bytes, staged in ((2, None), (2, 4), (4, None)):
        found = candidates(elem_bytes=elem_bytes, min_bn=2, m=4096, n=4096, flatten=True, staged_bytes=staged,
                           smem=smem)
        assert found
        for cfg in found:
            assert cfg.smem_bytes(elem_bytes, staged) <= smem.limit(cfg.CTAS_PER_SM)


def test_shared_memory_of_the_device(monkeypatch):
    """Read from PyTorch's device properties; Hopper's figures where they are missing."""
    from types import SimpleNamespace

    a100 = SimpleNamespace(shared_memory_per_block_optin=163 * 1024, shared_memory_per_multiprocessor=164 * 1024)
    for props, expected in ((a100, SharedMemory(164 * 1024, 163 * 1024)), (SimpleNamespace(), HOPPER)):
        plan.shared_memory.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, props=props: props)
        assert plan.shared_memory(0) == expected
    plan.shared_memory.cache_clear()


def test_what_cannot_be_timed_takes_a_choice_made_before_or_the_first_with_a_warning(cache_dir):
    """While a CUDA graph is captured no kernel can be timed: a choice on disk is taken silently;
    without one the first candidate, with a warning that says why, and nothing is written (a
    later tuning outside the capture is not pre-empted)."""
    never = lambda cfg: pytest.fail("timed a config during a capture")  # noqa: E731
    with pytest.warns(UserWarning, match="captured"):
        assert tuning.choose("k6", CONFIGS, never, cannot_time="being captured") == CONFIGS[0]
    assert not (cache_dir / "tuning.json").exists()
    assert tuning.choose("k6", CONFIGS, {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}.__getitem__) == CONFIGS[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.choose("k6", CONFIGS, never, cannot_time="being captured") == CONFIGS[1]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_a_first_call_captured_into_a_cuda_graph_runs_untuned_and_replays_right(cache_dir):
    torch.manual_seed(0)
    a = torch.randn(200, 96, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(96, 136, device=DEVICE, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="CUDA graph"), torch.cuda.graph(graph):
        out = codetta.gemm(a, b)
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), (a.float() @ b.float()).bfloat16().float(), rtol=2e-2, atol=2e-2)
