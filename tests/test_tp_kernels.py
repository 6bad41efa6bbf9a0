"""kernels/triton_tp.py under Triton's interpreter (tiny shapes): add_fixed against torch's integer sums,
and reduce_p2p's sums and flag protocol with two ranks' buffers and signal pads in one process (the
interpreter runs one program at a time, so each rank's kernel runs with its peer's signals already
given; tests/gpu/test_gpu_tp.py runs it across two GPUs)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from localllm.kernels.triton_tp import (P2P_BLOCK, P2P_PROGRAMS, PAD_SLOTS, PUSH_SLOTS, add_fixed,  # noqa: E402
                                       push_buffer_size, push_grid, reduce_p2p, reduce_push)


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


@pytest.mark.parametrize("assign", [False, True])
def test_reduce_p2p_one_rank(assign):
    """Rank 0 of 2, its peer's signal given: x gets buffer 0 + buffer 1 (all P2P_PROGRAMS programs, each
    several chunks); both buffers are left as they were (the peer may still read ours), the previous
    buffer is cleared; rank 0's own flags are taken and its flags set in rank 1's pad; no timeout."""
    rows, cols = 2, P2P_BLOCK * P2P_PROGRAMS // 2 + 24  # > P2P_PROGRAMS chunks: programs loop
    bufs = [_fixed((rows * cols,), 3), _fixed((rows * cols,), 4)]
    parts = [b.clone() for b in bufs]
    prev = _fixed((rows, cols), 12)
    pads = [torch.zeros(PAD_SLOTS * 2, dtype=torch.int32) for _ in range(2)]
    programs = min(P2P_PROGRAMS, -(-rows * cols // P2P_BLOCK))
    for g in range(programs):  # rank 1 has begun this reduction
        pads[0][g * 2 + 1] = 1
    x = _fixed((rows, cols), 5)
    want = (parts[0] + parts[1]).view(rows, cols) + (0 if assign else x)
    err = torch.zeros(1, dtype=torch.int32)
    reduce_p2p(x, _addresses(bufs), _addresses(pads), err, rank=0, world=2, assign=assign, prev=prev, spins=100)
    assert err.item() == 0
    assert torch.equal(x, want)
    assert torch.equal(bufs[0], parts[0]) and torch.equal(bufs[1], parts[1]) and not prev.any()
    assert not pads[0].any()  # taken
    assert pads[1][[g * 2 for g in range(programs)]].eq(1).all() and pads[1].sum().item() == programs


def test_reduce_p2p_alone_and_timeout():
    """world 1: x += its own buffer, no flags; a peer that never signals: err set after `spins` polls."""
    buf = _fixed((40,), 6)
    x = _fixed((2, 20), 7)
    want = x + buf.view(2, 20)
    err = torch.zeros(1, dtype=torch.int32)
    pad = torch.zeros(PAD_SLOTS, dtype=torch.int32)
    reduce_p2p(x, _addresses([buf]), _addresses([pad]), err, rank=0, world=1)
    assert torch.equal(x, want) and err.item() == 0
    bufs = [_fixed((40,), 8), _fixed((40,), 9)]
    pads = [torch.zeros(PAD_SLOTS * 2, dtype=torch.int32) for _ in range(2)]
    reduce_p2p(x, _addresses(bufs), _addresses(pads), err, rank=1, world=2, spins=5)
    assert err.item() == 1


def _reducers(rows, cols):
    """Two ranks' P2PReducers (backends/cuda_tp.py) in one process: their buffers, addresses and signal
    pads as symmetric memory would give them (tensors on the CPU)."""
    from localllm.backends.cuda_tp import P2PReducer
    from localllm.parallel import TensorParallel

    bufs = [torch.zeros(3, rows, cols, dtype=torch.int64) for _ in range(2)]
    pads = [torch.zeros(PAD_SLOTS * 2, dtype=torch.int32) for _ in range(2)]
    addresses = torch.tensor([[b[j].data_ptr() for b in bufs] for j in range(3)], dtype=torch.int64)
    out = []
    for r in range(2):
        red = object.__new__(P2PReducer)  # (its set-up needs CUDA symmetric memory)
        red.tp, red.bufs, red.addresses, red.pads = TensorParallel(r, 2), bufs[r], addresses, _addresses(pads)
        red.err, red.last, red.cur = torch.zeros(1, dtype=torch.int32), None, 0
        out.append(red)
    programs = min(P2P_PROGRAMS, -(-rows * cols // P2P_BLOCK))
    for g in range(programs):  # rank 1 begins first: rank 0's kernel runs first here, then rank 1's, each call
        pads[0][g * 2 + 1] = 1
    return out, pads


def test_p2p_reducer_steps_in_turn():
    """Two steps of a decoder's reductions (the embedding's assign, then four sums) of two ranks, each
    call's kernels run rank 0 then rank 1 (a peer reads our buffer after our kernel ran: the buffer must
    still hold our part): both ranks get the exact sums, every buffer a product writes is zero before,
    and no two reductions in a row share a buffer."""
    rows, cols = 1, 3000
    reds, pads = _reducers(rows, cols)
    xs = [torch.zeros(rows, cols, dtype=torch.int64) for _ in range(2)]
    order = []
    for i, assign in enumerate([True, False, False, False, False] * 2):
        parts = [_fixed((rows, cols), 20 + 2 * i + r) for r in range(2)]
        want = parts[0] + parts[1] + (0 if assign else xs[0])
        for r, red in enumerate(reds):
            buf = red.take(assign)
            assert not buf.any(), f"reduction {i}: rank {r}'s buffer {red.cur} not cleared"
            buf.copy_(parts[r])
        order.append(reds[0].cur)
        for r, red in enumerate(reds):
            red.reduce(xs[r], assign)
            assert red.err.item() == 0
        assert torch.equal(xs[0], want) and torch.equal(xs[1], want), i
    assert order == [0, 1, 2, 1, 2] * 2
    assert not pads[1].any()  # every flag rank 0 set was taken (rank 0's own: rank 1's last, for a next call)


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
