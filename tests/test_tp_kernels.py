"""kernels/triton_tp.py under Triton's interpreter (tiny shapes): add_fixed against torch's integer sums,
and reduce_push's sums, epochs and both protocols (flags, LL) with two or three ranks' symmetric
buffers in one process (the interpreter runs one kernel at a time, so every rank's push half runs
before any rank's sum half; tests/gpu/test_gpu_tp_graphs.py runs the whole kernel across two GPUs)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from localllm.kernels.triton_tp import PUSH_SLOTS, add_fixed, push_buffer_size, push_grid, reduce_push  # noqa: E402


def _fixed(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 40), 1 << 40, shape, generator=g, dtype=torch.int64)


@pytest.mark.parametrize("assign", [False, True])
def test_add_fixed(assign):
    x, red = _fixed((3, 1100), 1), _fixed((3, 1100), 2)
    want = red.clone() if assign else x + red
    add_fixed(x, red, assign=assign)
    assert torch.equal(x, want) and not red.any()


def _addresses(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)


def test_embed_fixed_vocabulary_parts():
    """Two ranks' vocabulary rows of an embedding (ids of both parts, the first and last row of each):
    each rank's masked lookup, summed, is the whole lookup's bits (triton_decode.embed_fixed)."""
    from localllm.kernels.triton_decode import embed_fixed

    g = torch.Generator().manual_seed(10)
    emb = torch.randn(8, 40, generator=g).to(torch.bfloat16)
    tokens = torch.tensor([0, 3, 4, 7, 5], dtype=torch.long)
    whole = torch.zeros(5, 40, dtype=torch.int64)
    embed_fixed(tokens, emb, whole, block=32)
    parts = []
    for r in range(2):
        x = torch.full((5, 40), 99, dtype=torch.int64)
        embed_fixed(tokens, emb[4 * r:4 * r + 4].contiguous(), x, block=32, first=4 * r)
        parts.append(x)
    assert torch.equal(parts[0] + parts[1], whole)
    assert not parts[0][2:].any() and not parts[1][:2].any()


def _push_ranks(n, world=2):
    """world ranks' symmetric buffers (zero), their addresses, epoch counters and error flags (CPU)."""
    bufs = [torch.zeros(push_buffer_size(n, world), dtype=torch.int64) for _ in range(world)]
    ctrs = [torch.zeros(PUSH_SLOTS, dtype=torch.int64) for _ in range(world)]
    errs = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
    return bufs, _addresses(bufs), ctrs, errs


@pytest.mark.parametrize("world,ll", [(2, False), (3, False), (2, True), (3, True)])
def test_reduce_push_halves_in_turn(world, ll):
    """A sequence of reductions with different grids (1-row and 3-row messages, assign and add) of
    `world` ranks, each reduction's push half run on every rank, then its sum half (the interpreter
    runs one kernel at a time): every rank's x is the exact sum, every accumulator is cleared, the
    epoch counters of all slots equal the reductions so far, and each rank's flags of the last two
    parities hold those epochs from every peer (the flag protocol; LL sets none)."""
    cols = 1300  # 3 rows: 8 programs of 512; 1 row: 3 programs
    bufs, peers, ctrs, errs = _push_ranks(3 * cols, world)
    xs = [torch.zeros(3 * cols, dtype=torch.int64) for _ in range(world)]
    for k, (rows, assign) in enumerate([(1, True), (3, False), (1, False), (3, False), (3, True), (1, False)]):
        n = rows * cols
        parts = [_fixed((n,), 40 + 7 * k + r) for r in range(world)]
        accs = [p.clone() for p in parts]
        want = sum(parts) + (0 if assign else xs[0][:n])
        for r in range(world):
            reduce_push(xs[r][:n], accs[r], peers, ctrs[r], errs[r], r, world, assign, spins=50, halves="push", ll=ll)
        for r in range(world):
            reduce_push(xs[r][:n], accs[r], peers, ctrs[r], errs[r], r, world, assign, spins=50, halves="sum", ll=ll)
        for r in range(world):
            assert errs[r].item() == 0 and torch.equal(xs[r][:n], want), (k, r)
            assert not accs[r].any() and ctrs[r].eq(k + 1).all(), (k, r)
            flags = bufs[r][:2 * PUSH_SLOTS * world].view(2, PUSH_SLOTS, world)
            g = push_grid(n)
            others = [p for p in range(world) if p != r]
            if ll:
                assert not flags.any()
            else:
                assert flags[(k + 1) % 2, :g][:, others].eq(k + 1).all() and not flags[:, :, r].any()


@pytest.mark.parametrize("ll", [False, True])
def test_reduce_push_waits_for_every_peer(ll):
    """A rank whose peer has not pushed this epoch (a flag of the last one: stale, a peer gone) gives up
    after `spins` polls and sets err; with the flag, the same call's sum is exact."""
    n = 700
    bufs, peers, ctrs, errs = _push_ranks(n)
    acc, x = _fixed((n,), 60), torch.zeros(n, dtype=torch.int64)
    reduce_push(x, acc.clone(), peers, ctrs[0], errs[0], 0, 2, assign=True, spins=5, ll=ll)
    assert errs[0].item() == 1
    other = _fixed((n,), 61)
    reduce_push(x, other.clone(), peers, ctrs[1], errs[1], 1, 2, assign=True, spins=5, halves="push", ll=ll)
    errs[0].zero_()
    ctrs[0].zero_()
    reduce_push(x, acc.clone(), peers, ctrs[0], errs[0], 0, 2, assign=True, spins=5, ll=ll)
    assert errs[0].item() == 0 and torch.equal(x, acc + other)
