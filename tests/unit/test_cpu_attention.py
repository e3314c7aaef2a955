"""CPU paged decode-attention library: accuracy against float64, determinism, append, bad input, GIL."""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from dataclasses import replace

import pytest
import torch
from kernel_helpers import available_isas, forced_isa, reference_paged_decode_attention

from neo_backend.cpu import build, library
from neo_backend.cpu.abi import Isa
from neo_backend.cpu.handoff import Flags, IterationLane
from neo_backend.cpu.ops import Kernels
from neo_backend.errors import KernelInputError
from neo_backend.executor.host_attention import attention_threads
from neo_backend.layers.attention import split_qkv

pytestmark = pytest.mark.timeout(120)

TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-3, torch.float32: 1e-5}
CORES = len(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def lib():
    return library.default()


def kernels(threads: int = CORES) -> Kernels:
    return Kernels(library.default(), threads)


def make_case(
    seed: int,
    lens: list[int],
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype = torch.float32,
    spare_blocks: int = 7,
):
    """Random q and caches; each sequence's blocks are scattered over a shuffled pool with spare blocks."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / block_size) for n in lens]
    max_blocks = max(per_seq) + 2
    num_blocks = sum(per_seq) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    # Entries past a sequence's context hold junk ids (even out of range): the kernel must not read them.
    tables = torch.full((len(lens), max_blocks), num_blocks + 1000, dtype=torch.int32)
    start = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = perm[start : start + nb]
        start += nb
    q = (torch.randn(len(lens), hq, d, generator=g) * 2).to(q_dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-row (batch, head) error relative to that row's largest reference magnitude."""
    return float(((out.double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max())


def run(
    q, k_cache, v_cache, tables, lens, threads: int = CORES, split_long: bool = True, ops: Kernels | None = None
) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))  # poison: any element the kernel leaves unwritten fails
    result = (ops or kernels(threads)).paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 1.0 / math.sqrt(q.shape[-1]), out=out, split_long=split_long
    )
    assert result is out
    return out


def reference(q, k_cache, v_cache, tables, lens) -> torch.Tensor:
    return reference_paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0 / math.sqrt(q.shape[-1]))


def ragged_lens(seed: int, n: int = 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1, 2000] + torch.randint(1, 2001, (n - 2,), generator=g).tolist()


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (16, 4), (16, 2)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_matches_float64_reference(block_size, hq, hkv, d, kv_dtype):
    seed = block_size * 1000 + hq * 10 + d
    case = make_case(seed, ragged_lens(seed), block_size, hq, hkv, d, kv_dtype)
    assert rel_err(run(*case), reference(*case)) <= TOL[kv_dtype]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("hq,hkv,d", [(12, 2, 64), (32, 2, 128), (8, 8, 256)], ids=["gqa6", "gqa16", "d256"])
def test_every_simd_path(isa, hq, hkv, d, lib):
    if isa not in available_isas(lib):
        pytest.skip(f"this CPU has no {isa} (best: {library.best_isa(lib)})")
    with forced_isa(lib, isa):
        assert library.active_isa(lib) == isa
        for kv_dtype in (torch.float16, torch.bfloat16, torch.float32):
            case = make_case(d + hq, [1, 15, 16, 17, 700], 16, hq, hkv, d, kv_dtype)
            assert rel_err(run(*case), reference(*case)) <= TOL[kv_dtype], (isa, kv_dtype)


@pytest.mark.parametrize("dtype,unit_roundoff", [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)], ids=str)
def test_query_in_cache_dtype(dtype, unit_roundoff):
    case = make_case(3, ragged_lens(3), 16, 16, 4, 128, dtype, q_dtype=dtype)
    out = run(*case)
    assert out.dtype == dtype
    # Only the final rounding to the output dtype is added to the fp32 error.
    assert rel_err(out, reference(*case)) <= TOL[dtype] + unit_roundoff


def test_threads_and_split_agree():
    lens = [6000, 1, 300, 33, 2048, 17, 1000, 5]
    case = make_case(5, lens, 16, 16, 4, 128, torch.float16)
    whole = run(*case, threads=1, split_long=False)
    split = run(*case, threads=1, split_long=True)
    for threads in (2, 3, 4, 15):
        # Work items and merge order do not depend on the thread count: bitwise the same results.
        assert torch.equal(run(*case, threads=threads, split_long=False), whole)
        assert torch.equal(run(*case, threads=threads, split_long=True), split)
    # Splitting only reorders fp32 sums: normwise the two agree within 1e-6; row by row, a 6000-token
    # row summed in one piece drifts a few 1e-6 from float64 (split rows are closer).
    diff = (split.double() - whole.double()).norm() / whole.double().norm()
    assert diff <= 1e-6 and rel_err(split, whole.double()) <= 1e-5
    ref = reference(*case)
    assert rel_err(whole, ref) <= 1e-5 and rel_err(split, ref) <= 1e-5


@pytest.mark.parametrize("lens", [[1100], [1100, 700]], ids=str)
def test_how_finely_the_team_splits_heads_changes_no_bit(lens):
    """A few MHA requests: the team's size sets how finely the KV heads split (from whole segments with one
    thread, through two KV heads an item with 15 or 16, where longer runs of a row win over finer balance, to
    one with 32), never the results."""
    case = make_case(7, lens, 16, 16, 16, 64, torch.bfloat16)
    alone = run(*case, threads=1)
    for threads in (2, 15, 16, 32):
        assert torch.equal(run(*case, threads=threads), alone), threads
    assert rel_err(alone, reference(*case)) <= TOL[torch.bfloat16]


def test_single_long_sequence_split_across_threads():
    case = make_case(6, [5000], 16, 8, 2, 128, torch.float32)
    ref = reference(*case)
    for threads in (1, 2, 8):
        assert rel_err(run(*case, threads=threads), ref) <= 1e-5


@pytest.mark.parametrize("threads", [0, -1, True, 2.0, None])
def test_a_thread_count_that_is_not_a_positive_int_is_refused(threads):
    with pytest.raises(KernelInputError, match="num_threads"):
        Kernels(library.default(), threads)


def test_the_attention_team_size():
    cpus, cuda, cpu = {0, 1, 2, 3}, torch.device("cuda"), torch.device("cpu")
    assert attention_threads(3, cpus, None, cuda) == 3
    assert attention_threads(None, cpus, None, cuda) == 3, "one core stays with the launching thread"
    assert attention_threads(None, {0}, None, cuda) == 1
    assert attention_threads(None, cpus, None, cpu) == 4
    assert attention_threads(None, cpus, 7, cuda) == 4, "with engine_cpu, every CPU but that one is the team's"


def test_empty_batch():
    q, k, v, t, lens = make_case(9, [5], 16, 4, 4, 64, torch.float16)
    out = kernels().paged_decode_attention(q[:0], k, v, t[:0], lens[:0], 0.1)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_append_kv(dtype):
    g = torch.Generator().manual_seed(10)
    k_cache = torch.randn(6, 16, 4, 64, generator=g).to(dtype)
    v_cache = torch.randn(6, 16, 4, 64, generator=g).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5 * 16 + 15, 0, 2 * 16 + 3], dtype=torch.int64)
    k = torch.randn(3, 4, 64, generator=g).to(dtype)
    v = torch.randn(3, 4, 64, generator=g).to(dtype)
    kernels().append_kv(k, v, k_cache, v_cache, slots)
    k_expect, v_expect = k_before.view(-1, 4, 64).clone(), v_before.view(-1, 4, 64).clone()
    k_expect[slots], v_expect[slots] = k, v
    assert torch.equal(k_cache.view(-1, 4, 64), k_expect)
    assert torch.equal(v_cache.view(-1, 4, 64), v_expect)


def test_append_then_attend():
    q, k_cache, v_cache, tables, lens = make_case(11, [20, 33], 16, 8, 2, 128, torch.bfloat16)
    k_new = torch.randn(2, 2, 128).to(torch.bfloat16)
    v_new = torch.randn(2, 2, 128).to(torch.bfloat16)
    lens = lens + 1  # the new token is the last one of each context
    slots = torch.stack([tables[i, (int(n) - 1) // 16].long() * 16 + (int(n) - 1) % 16 for i, n in enumerate(lens)])
    kernels().append_kv(k_new, v_new, k_cache, v_cache, slots)
    case = (q, k_cache, v_cache, tables, lens)
    assert rel_err(run(*case), reference(*case)) <= 1e-3


# --- bad input: KernelInputError before any C code runs -------------------------------------------------


def good_args():
    q, k, v, t, lens = make_case(12, [40, 17], 16, 8, 2, 64, torch.float16)
    return dict(q=q, k_cache=k, v_cache=v, block_tables=t, context_lens=lens, scale=0.125)


BAD_ATTENTION_INPUTS = {
    "q not a tensor": lambda a: a.update(q=a["q"].tolist()),
    "q on another device": lambda a: a.update(q=torch.empty(a["q"].shape, device="meta")),
    "q int dtype": lambda a: a.update(q=a["q"].to(torch.int32)),
    "q bf16 with fp16 cache": lambda a: a.update(q=a["q"].to(torch.bfloat16)),
    "q 2-D": lambda a: a.update(q=a["q"][0]),
    "q not contiguous": lambda a: a.update(q=a["q"].transpose(0, 1).contiguous().transpose(0, 1)),
    "q head_dim mismatch": lambda a: a.update(q=a["q"][..., :32].contiguous()),
    "heads not a multiple": lambda a: a.update(q=a["q"][:, :3].contiguous()),
    "cache float64": lambda a: a.update(k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double()),
    "k/v dtype mismatch": lambda a: a.update(v_cache=a["v_cache"].float()),
    "k/v shape mismatch": lambda a: a.update(v_cache=a["v_cache"][:-1].contiguous()),
    "cache not contiguous": lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)),
    "unsupported head_dim": lambda a: a.update(
        q=a["q"][..., :48].contiguous(),
        k_cache=a["k_cache"][..., :48].contiguous(),
        v_cache=a["v_cache"][..., :48].contiguous(),
    ),
    "block_tables int64": lambda a: a.update(block_tables=a["block_tables"].long()),
    "block_tables rows != batch": lambda a: a.update(block_tables=a["block_tables"][:1].contiguous()),
    "context_lens int64": lambda a: a.update(context_lens=a["context_lens"].long()),
    "context_lens length != batch": lambda a: a.update(context_lens=a["context_lens"][:1].contiguous()),
    "block id too large": lambda a: a["block_tables"].__setitem__((0, 2), a["k_cache"].shape[0]),
    "negative block id": lambda a: a["block_tables"].__setitem__((1, 1), -1),
    "context zero": lambda a: a["context_lens"].__setitem__(1, 0),
    "context beyond table": lambda a: a["context_lens"].__setitem__(0, a["block_tables"].shape[1] * 16 + 1),
    "out wrong dtype": lambda a: a.update(out=torch.empty(a["q"].shape, dtype=torch.float16)),
    "out wrong shape": lambda a: a.update(out=torch.empty(1, 8, 64)),
    "scale nan": lambda a: a.update(scale=float("nan")),
}


class UnreachableLibrary:
    """Stands in for the library: any attempt to reach it fails the test."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the C library was reached ({name}) with bad input")


@pytest.fixture
def no_c_calls() -> Kernels:
    return Kernels(UnreachableLibrary(), 1)


@pytest.mark.parametrize("mutate", BAD_ATTENTION_INPUTS.values(), ids=BAD_ATTENTION_INPUTS.keys())
def test_bad_attention_input_raises_before_c(mutate, no_c_calls):
    args = good_args()
    mutate(args)
    with pytest.raises(KernelInputError):
        no_c_calls.paged_decode_attention(**args)


def test_junk_block_ids_past_the_context_are_ignored():
    args = good_args()
    args["block_tables"][0, 3:] = -5  # context 40 uses 3 blocks of 16
    case = (args["q"].float(), args["k_cache"], args["v_cache"], args["block_tables"], args["context_lens"])
    assert rel_err(run(*case), reference(*case)) <= 1e-3


def good_append_args():
    k_cache = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    return dict(
        k=torch.ones(3, 2, 64, dtype=torch.float16),
        v=torch.ones(3, 2, 64, dtype=torch.float16),
        k_cache=k_cache,
        v_cache=torch.zeros_like(k_cache),
        slot_mapping=torch.tensor([0, 5, 63]),
    )


BAD_APPEND_INPUTS = {
    "slot too large": lambda a: a["slot_mapping"].__setitem__(2, 64),
    "negative slot": lambda a: a["slot_mapping"].__setitem__(0, -1),
    "slots int32": lambda a: a.update(slot_mapping=a["slot_mapping"].int()),
    "slots length != batch": lambda a: a.update(slot_mapping=a["slot_mapping"][:2].contiguous()),
    "k dtype != cache": lambda a: a.update(k=a["k"].float()),
    "v heads mismatch": lambda a: a.update(v=torch.ones(3, 1, 64, dtype=torch.float16)),
    "k not contiguous": lambda a: a.update(k=torch.ones(64, 2, 3, dtype=torch.float16).transpose(0, 2)),
    "v_cache dtype": lambda a: a.update(v_cache=a["v_cache"].float()),
}


@pytest.mark.parametrize("mutate", BAD_APPEND_INPUTS.values(), ids=BAD_APPEND_INPUTS.keys())
def test_bad_append_input_raises_before_c(mutate, no_c_calls):
    args = good_append_args()
    mutate(args)
    with pytest.raises(KernelInputError):
        no_c_calls.append_kv(**args)


def test_the_library_refuses_a_simd_path_this_cpu_lacks(lib):
    best = lib.neo_max_isa()
    assert lib.neo_set_isa(len(Isa)) == -1 and lib.neo_set_isa(-1) == -1
    if best < Isa.AVX512:
        assert lib.neo_set_isa(Isa.AVX512) == -1
    assert lib.neo_isa() == best


# --- the GIL is released while the kernel runs ----------------------------------------------------------


def test_python_thread_progresses_during_a_kernel_call(lib):
    case = make_case(13, [2000] * 8, 16, 32, 8, 128, torch.float16)
    with forced_isa(lib, "scalar"):  # slow path: one call lasts long enough to observe
        span: list[float] = []

        def worker():
            t0 = time.perf_counter()
            run(*case, threads=1)
            span.extend((t0, time.perf_counter()))

        thread = threading.Thread(target=worker)
        ticks = []
        thread.start()
        while thread.is_alive():
            ticks.append(time.perf_counter())
            sum(range(200))
        thread.join()
    start, end = span
    inside = [t for t in ticks if start + 0.005 < t < end - 0.005]
    assert end - start > 0.05, "the call was too short to tell"
    # With the GIL held for the whole call, this thread could not run at all while it lasted.
    assert len(inside) >= 10, f"only {len(inside)} iterations during a {end - start:.3f}s kernel call"


# --- decode_iteration: the pipeline's whole-iteration loop ----------------------------------------------


def iteration_case(num_layers: int = 3):
    """Two lanes (sequences 0-1 and 2 of one case) over `num_layers` layers' caches of the same shape; each
    lane's new token goes to the slot after its context."""
    lanes, caches = (
        [],
        [
            make_case(20 + layer, [25, 40, 9], 16, 8, 2, 64, torch.bfloat16, q_dtype=torch.bfloat16, spare_blocks=12)[
                1:3
            ]
            for layer in range(num_layers)
        ],
    )
    k_caches, v_caches = [c[0] for c in caches], [c[1] for c in caches]
    for lane_rows, seed in (([0, 1], 1), ([2], 2)):
        q, _, _, tables, lens = make_case(
            20, [25, 40, 9], 16, 8, 2, 64, torch.bfloat16, q_dtype=torch.bfloat16, spare_blocks=12
        )
        g = torch.Generator().manual_seed(seed)
        rows = torch.tensor(lane_rows)
        tables, lens = tables[rows].contiguous(), lens[rows] + 1
        slots = torch.stack([tables[i, (int(n) - 1) // 16].long() * 16 + (int(n) - 1) % 16 for i, n in enumerate(lens)])
        ready = Flags(num_layers, 0.0)
        lanes.append(
            IterationLane(
                q[rows].contiguous(),
                torch.randn(len(rows), 2, 64, generator=g).to(torch.bfloat16),
                torch.randn(len(rows), 2, 64, generator=g).to(torch.bfloat16),
                torch.full((len(rows), 8, 64), float("nan"), dtype=torch.bfloat16),
                tables,
                lens,
                slots,
                ready,
            )
        )
    return k_caches, v_caches, lanes


def test_decode_iteration_equals_appending_and_attending_layer_by_layer():
    k_caches, v_caches, lanes = iteration_case()
    expected_k, expected_v = [k.clone() for k in k_caches], [v.clone() for v in v_caches]
    for lane in lanes:
        lane.ready.values[:] = 1
    done = Flags(len(k_caches) * len(lanes), 0.0)
    seconds = kernels().decode_iteration(k_caches, v_caches, lanes, done, 0.125, timeout_s=30)
    assert seconds.shape == (6,) and (seconds > 0).all() and (done.values == 1).all()
    for lane in lanes:
        for k, v in zip(expected_k, expected_v):
            kernels().append_kv(lane.k, lane.v, k, v, lane.slots)
        last = kernels().paged_decode_attention(
            lane.q, expected_k[-1], expected_v[-1], lane.block_tables, lane.context_lens, 0.125
        )
        assert torch.equal(lane.out, last), "out holds the last layer's attention"
    assert all(torch.equal(a, b) for a, b in zip(k_caches + v_caches, expected_k + expected_v))


def test_decode_iteration_reads_q_k_v_as_views_of_one_packed_buffer():
    """The pipeline copies each host row's q, k and v down in one piece (`split_qkv` views of it): the same rows
    packed give the same attention and the same appended caches as contiguous tensors."""
    k_caches, v_caches, lanes = iteration_case()
    packed_k, packed_v = [k.clone() for k in k_caches], [v.clone() for v in v_caches]
    packed_lanes = []
    for lane in lanes:
        qkv = torch.cat([lane.q.flatten(1), lane.k.flatten(1), lane.v.flatten(1)], dim=1)
        q, k, v = split_qkv(qkv, 8, 2, 64)
        assert len(q) == 1 or q.stride(0) == k.stride(0) == qkv.shape[1]
        out = torch.full_like(lane.out, float("nan"))
        packed_lanes.append(IterationLane(q, k, v, out, lane.block_tables, lane.context_lens, lane.slots, lane.ready))
        lane.ready.values[:] = 1
    for caches, iteration_lanes in (((k_caches, v_caches), lanes), ((packed_k, packed_v), packed_lanes)):
        kernels().decode_iteration(*caches, iteration_lanes, Flags(6, 0.0), 0.125, timeout_s=30)
    for lane, packed in zip(lanes, packed_lanes):
        assert torch.equal(lane.out, packed.out)
    assert all(torch.equal(a, b) for a, b in zip(k_caches + v_caches, packed_k + packed_v))


def test_decode_iteration_stops_where_the_launching_side_gave_up():
    k_caches, v_caches, lanes = iteration_case()
    lanes[0].ready.values[:] = 1
    lanes[1].ready.values[:] = [1, Flags.FAILED, Flags.FAILED]  # its layer-1 step was never launched
    done = Flags(6, 0.0)
    kernels().decode_iteration(k_caches, v_caches, lanes, done, 0.125, timeout_s=30)
    assert done.values.tolist() == [1, 1, 1, -1, -1, -1]


def test_decode_iteration_bad_input_raises_before_c(no_c_calls):
    k_caches, v_caches, lanes = iteration_case()
    done, too_few = Flags(6, 0.0), Flags(5, 0.0)
    fp32_lane = IterationLane(
        lanes[1].q.float(),
        lanes[1].k,
        lanes[1].v,
        lanes[1].out.float(),
        lanes[1].block_tables,
        lanes[1].context_lens,
        lanes[1].slots,
        lanes[1].ready,
    )
    iteration = no_c_calls.decode_iteration
    calls = {
        "a layer without a v cache": lambda: iteration(k_caches, v_caches[:2], lanes, done, 0.125, 30),
        "a layer's cache of another shape": lambda: iteration(
            k_caches[:2] + [k_caches[2][:-1].contiguous()], v_caches, lanes, done, 0.125, 30
        ),
        "lanes with different q dtypes": lambda: iteration(k_caches, v_caches, [lanes[0], fp32_lane], done, 0.125, 30),
        "too few done flags": lambda: iteration(k_caches, v_caches, lanes, too_few, 0.125, 30),
        "k's and v's rows apart by different strides": lambda: iteration(
            k_caches,
            v_caches,
            [replace(lanes[0], v=torch.cat([lanes[0].v, lanes[0].v], dim=1)[:, :2])],
            done,
            0.125,
            30,
        ),
        "q not contiguous within a row": lambda: iteration(
            k_caches,
            v_caches,
            [replace(lanes[0], q=lanes[0].q.transpose(1, 2).contiguous().transpose(1, 2))],
            done,
            0.125,
            30,
        ),
    }
    for call in calls.values():
        with pytest.raises(KernelInputError):
            call()


# --- another build of the library (bench/kernel_ab.py) ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)  # a full compile: minutes on a small, busy host
def test_a_copy_of_the_sources_builds_apart_and_its_kernels_serve_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("NEO_KERNEL_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "kernels"
    shutil.copytree(build.KERNEL_DIR, copy)
    assert build.build_key(copy) == build.build_key()
    main = copy / build.MAIN_SOURCE
    main.write_text(
        main.read_text().replace("int neo_max_isa(void) { return g_max_isa; }", "int neo_max_isa(void) { return 0; }")
    )
    assert build.build_key(copy) != build.build_key()
    other = library.load(build.build(kernel_dir=copy))
    assert library.best_isa(other) == "scalar"
    case = make_case(15, [40, 3], 16, 8, 2, 64, torch.float32)
    assert rel_err(run(*case, ops=Kernels(other, CORES)), reference(*case)) <= 1e-5
