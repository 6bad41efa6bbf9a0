"""The CUDA decode step at TP=2 (backends/cuda_graph.GraphDecoder with backends/cuda_tp.py's
collectives: o/down partial sums reduced as int64 fixed point, the vocabulary-part embedding, the
gathered head), run on the CPU: 2 processes with gloo, Triton's interpreter, eager steps
(tests/tp_graph_worker.py). Oracle: the same decoder on the whole model (TP=1; itself tested against
the fp32 reference in test_triton_kernels). Both ranks hold the same logits bits; TP=2's are TP=1's
within the rounding of the products' per-part sums; the greedy graph's ids are TP=1's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port

WORKER = Path(__file__).with_name("tp_graph_worker.py")
TYPES = ["Q8_0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp_graph")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(port), str(out), *TYPES], env=env)
             for r in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    return {(t, r): torch.load(out / f"{t}-{r}.pt") for t in TYPES for r in range(2)}


@pytest.mark.parametrize("wtype", TYPES)
def test_tp2_decode_step_matches_tp1(runs, wtype):
    r0, r1 = runs[(wtype, 0)], runs[(wtype, 1)]
    assert torch.equal(r0["tp2"], r1["tp2"]) and torch.equal(r0["greedy2"], r1["greedy2"])  # the same bits
    one, two = r1["tp1"], r0["tp2"]
    assert two.shape == one.shape == (2, 128)
    err = ((two - one).norm(dim=-1) / one.norm(dim=-1)).max().item()
    assert err < 1e-5, err  # fp32 sums of the products' parts in another order (and fixed-point truncation)
    assert torch.equal(two.argmax(-1), one.argmax(-1))
    assert r0["greedy2"].tolist() == [int(one[0].argmax())]  # the greedy graph's argmax of the gathered logits
