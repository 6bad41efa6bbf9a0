"""One fuzz case from (run seed, target, case index): deterministic, so the parent and the worker build
the same case and a failing one can be rebuilt and saved. No torch here (the parent stays light)."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from fuzz_gguf_mutate import mutate
from fuzz_hf_mutate import mutate_folder
from fuzz_text_cases import make_case

TARGETS = ("gguf", "safetensors", "tokenizer")


@dataclass
class Seeds:
    gguf: dict[str, bytes]  # seed file name -> bytes
    hf: dict[str, dict[str, bytes]]  # seed folder name -> {file name: bytes}
    vocabs: list[str]  # tokenizer file paths


@dataclass
class Case:
    target: str
    idx: int
    what: list[str]  # the seed and mutations, for the report
    data: object  # gguf: bytes; safetensors: {file: bytes | None}; tokenizer: a JSON-able dict


def case_rng(run_seed: int, target: str, idx: int) -> random.Random:
    return random.Random(f"{run_seed}:{target}:{idx}")


def build_case(run_seed: int, target: str, idx: int, seeds: Seeds) -> Case:
    rng = case_rng(run_seed, target, idx)
    if target == "gguf":
        names = sorted(seeds.gguf)
        name, other = rng.choice(names), rng.choice(names)
        if rng.random() < 0.03:  # the unmutated seed now and then: the baseline must load and run
            return Case(target, idx, [name, "unmutated"], seeds.gguf[name])
        raw, what = mutate(seeds.gguf[name], seeds.gguf[other], rng)
        return Case(target, idx, [name] + what, raw)
    if target == "safetensors":
        name = rng.choice(sorted(seeds.hf))
        folder, what = mutate_folder(seeds.hf[name], rng)
        return Case(target, idx, [name] + what, folder)
    if target == "tokenizer":
        case = make_case(rng, seeds.vocabs)
        return Case(target, idx, [Path(case["name"]).name, case["op"], case.get("kind", "")], case)
    raise ValueError(f"unknown fuzz target {target!r}; known: {', '.join(TARGETS)}")


def write_case(case: Case, where: Path) -> Path:
    """The case on disk (a .gguf file, a model folder, or a .json tokenizer case); returns its path."""
    if where.is_dir():
        shutil.rmtree(where)
    elif where.exists():
        where.unlink()
    if case.target == "gguf":
        where.write_bytes(case.data)
        return where
    if case.target == "safetensors":
        where.mkdir(parents=True)
        for name, raw in case.data.items():
            if raw is not None:
                (where / name).write_bytes(raw)
        return where
    # surrogates (lone or from undecodable bytes) survive JSON's \\u escapes
    where.write_text(json.dumps(case.data, ensure_ascii=True))
    return where


def case_suffix(target: str) -> str:
    return {"gguf": ".gguf", "safetensors": "", "tokenizer": ".json"}[target]
