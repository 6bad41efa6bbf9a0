"""A model of the few PTX instructions the Triton kernels' inline assembly uses (as the PTX ISA defines
them, on 32-bit registers), so tests can run under the interpreter what only the GPU executes:
triton_table16's table lookups, triton_mma's packed byte widening."""

from __future__ import annotations

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 in its default mode: bytes {b, a} numbered 0..7; selector bit 3 replicates the byte's sign."""
    pool = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for i in range(4):
        sel = (selector >> (4 * i)) & 15
        byte = pool[sel & 7]
        out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
    return out


OPS = {"mov.b32": lambda a: a, "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b,
       "xor.b32": lambda a, b: a ^ b, "shr.b32": lambda a, b: a >> b, "shl.b32": lambda a, b: a << b,
       "sub.u32": lambda a, b: a - b, "prmt.b32": _prmt}


def run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run the instructions of text on 32-bit registers holding inputs ({"$1": word, ...}) -> every register."""
    regs = dict(inputs)
    for ins in text.strip().strip("{}").split(";"):
        if not ins.strip() or ins.strip().startswith(".reg"):
            continue
        name, ops = ins.split(None, 1)
        d, *src = [o.strip() for o in ops.split(",")]
        if name not in OPS:
            raise AssertionError(f"no model for {name}")
        regs[d] = OPS[name](*(int(o, 0) if o[0].isdigit() else regs[o] for o in src)) & MASK
    return regs
