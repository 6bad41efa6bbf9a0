"""kernels/triton_tp.py under Triton's interpreter (tiny shapes): add_fixed against torch's integer sums,
and reduce_p2p's sums and flag protocol with two ranks' buffers and signal pads in one process (the
interpreter runs one program at a time, so each rank's kernel runs with its peer's signals already
given; tests/gpu/test_gpu_tp.py runs it across two GPUs)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from localllm.kernels.triton_tp import P2P_BLOCK, P2P_PROGRAMS, PAD_SLOTS, add_fixed, reduce_p2p  # noqa: E402


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
def test_reduce_p2p_rank_in_turn(assign):
    """Rank 0 of 2, its peer's first- and second-barrier signals given: x gets buffer 0 + buffer 1 (all
    P2P_PROGRAMS programs, each several chunks), rank 0's buffer is cleared, rank 1's is untouched, rank
    0's own flags are taken and its flags set in rank 1's pad; no timeout."""
    rows, cols = 2, P2P_BLOCK * P2P_PROGRAMS // 2 + 24  # > P2P_PROGRAMS chunks: programs loop
    bufs = [_fixed((rows * cols,), 3), _fixed((rows * cols,), 4)]
    parts = [b.clone() for b in bufs]
    pads = [torch.zeros(PAD_SLOTS * 2, dtype=torch.int32) for _ in range(2)]
    programs = min(P2P_PROGRAMS, -(-rows * cols // P2P_BLOCK))
    for g in range(programs):  # rank 1 has signalled both barriers of every program
        pads[0][g * 2 + 1] = 1
        pads[0][(P2P_PROGRAMS + g) * 2 + 1] = 1
    x = _fixed((rows, cols), 5)
    want = (parts[0] + parts[1]).view(rows, cols) + (0 if assign else x)
    err = torch.zeros(1, dtype=torch.int32)
    reduce_p2p(x, _addresses(bufs), _addresses(pads), err, rank=0, world=2, assign=assign, spins=100)
    assert err.item() == 0
    assert torch.equal(x, want)
    assert not bufs[0].any() and torch.equal(bufs[1], parts[1])
    assert not pads[0].any()  # taken
    used = [g * 2 for g in range(programs)] + [(P2P_PROGRAMS + g) * 2 for g in range(programs)]
    assert pads[1][used].eq(1).all() and pads[1].sum().item() == len(used)


def test_reduce_p2p_alone_and_timeout():
    """world 1: x += its own buffer, no flags; a peer that never signals: err set after `spins` polls."""
    buf = _fixed((40,), 6)
    x, want = _fixed((2, 20), 7), None
    want = x + buf.view(2, 20)
    err = torch.zeros(1, dtype=torch.int32)
    pad = torch.zeros(PAD_SLOTS, dtype=torch.int32)
    reduce_p2p(x, _addresses([buf]), _addresses([pad]), err, rank=0, world=1)
    assert torch.equal(x, want) and not buf.any() and err.item() == 0
    bufs = [_fixed((40,), 8), _fixed((40,), 9)]
    pads = [torch.zeros(PAD_SLOTS * 2, dtype=torch.int32) for _ in range(2)]
    reduce_p2p(x, _addresses(bufs), _addresses(pads), err, rank=1, world=2, spins=5)
    assert err.item() == 1


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
