"""Tokenizers of Hugging Face model folders (safetensors checkpoints).

- tokenizer.json: run by `tokenizers.Tokenizer.from_file`, exactly as transformers' fast tokenizer
  (its own normalizer, pre-tokenizer and added tokens); special tokens in the text are only parsed
  with parse_special, via the library's `encode_special_tokens` switch.
- else tokenizer.model: run by `sentencepiece`, with the added tokens of tokenizer_config.json cut
  out first the way llama.cpp does (base.split_special).
BOS/EOS, add_bos and the chat template come from tokenizer_config.json, falling back to
config.json / generation_config.json (transformers' precedence).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..errors import LocalLLMError
from ..user_text import read_utf8_file
from .base import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED,
                   TOKEN_USER_DEFINED, Tokenizer, encodable)
from .bpe import byte_level_decode, library_encode, library_errors, native_stderr_silenced

SPACE = "\u2581"
MAX_VOCAB = 1 << 22  # token ids beyond this are a broken file, not a vocabulary (lists of this size fit)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    text = read_utf8_file(path, "tokenizer file")  # one line naming the byte that is not UTF-8
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LocalLLMError(f"cannot read {path}: {e}") from None
    except RecursionError:
        raise LocalLLMError(f"cannot read {path}: JSON nested too deeply") from None
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config's "eos_token" is a string or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> list[int]:
    """config.json's "eos_token_id" is an int or a list of ints."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    """The folder's default chat template, found where transformers' AutoTokenizer finds it:
    chat_template.jinja first (it replaces tokenizer_config.json's "chat_template"), then
    tokenizer_config.json (a string, or a list of named templates), then chat_template.json."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return read_utf8_file(jinja, "chat template")
    tpl = tok_cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tpl, str) and tpl:
        return tpl
    tpl = _read_json(folder / "chat_template.json").get("chat_template")
    return tpl if isinstance(tpl, str) and tpl else None


def load_hf_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer of a HF model folder (tokenizer.json, else tokenizer.model)."""
    folder = Path(folder)
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    configs = [_read_json(folder / "config.json"), _read_json(folder / "generation_config.json")]
    if (folder / "tokenizer.json").is_file():
        cls, path = HFJsonTokenizer, folder / "tokenizer.json"
    elif (folder / "tokenizer.model").is_file():
        cls, path = SentencePieceTokenizer, folder / "tokenizer.model"
    else:
        raise LocalLLMError(f"no tokenizer.json or tokenizer.model in {folder}")
    return cls(path, tok_cfg, configs, _chat_template(folder, tok_cfg))


def _special_ids(vocab: dict[str, int], tok_cfg: dict[str, Any], configs: list[dict[str, Any]]):
    """(bos_id, eos_id, extra stop ids): tokenizer_config's token strings first, then config ids."""
    def pick(name: str) -> tuple[int | None, list[int]]:
        found = [vocab[t]] if (t := _token_content(tok_cfg.get(name))) in vocab else []
        for cfg in configs:
            found += _ids(cfg.get(name + "_id"))
        return (found[0] if found else None), found

    bos, _ = pick("bos_token")
    eos, eos_all = pick("eos_token")
    return bos, eos, eos_all


class HFJsonTokenizer(Tokenizer):
    """tokenizer.json, encoded by the `tokenizers` library itself."""

    def __init__(self, path: Path, tok_cfg: dict[str, Any], configs: list[dict[str, Any]],
                 chat_template: str | None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        spec = _read_json(path)
        # a bare Exception, or a panic on odd model fields (its own message silenced: one line is ours)
        with library_errors(f"cannot load {path}"), native_stderr_silenced():
            self._hf = HFTokenizer.from_file(str(path))
        self._hf.no_truncation()
        self._hf.no_padding()
        vocab = self._hf.get_vocab(with_added_tokens=True)
        check_token_id(max(vocab.values(), default=0), path)
        tokens = [""] * (max(vocab.values(), default=-1) + 1)
        for text, tid in vocab.items():
            tokens[tid] = text
        types = [TOKEN_NORMAL] * len(tokens)
        for tid, added in self._hf.get_added_tokens_decoder().items():
            types[tid] = TOKEN_CONTROL if added.special else TOKEN_USER_DEFINED
        decoder = json.dumps(spec.get("decoder"))
        self._byte_level = '"ByteLevel"' in decoder
        spm_like = not self._byte_level and ('"Metaspace"' in decoder or '"ByteFallback"' in decoder)
        if spm_like:
            for tid, text in enumerate(tokens):
                if types[tid] == TOKEN_NORMAL and _BYTE_TOKEN.fullmatch(text):
                    types[tid] = TOKEN_BYTE
        self.kind = "bpe" if self._byte_level else "spm"
        self.pre = "tokenizer.json"
        bos, eos, stops = _special_ids(vocab, tok_cfg, configs)
        add_bos = tok_cfg.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = _template_adds_bos(spec, bos, tokens)
        super().__init__(tokens, types, bos_id=bos, eos_id=eos, add_bos=add_bos,
                         chat_template=chat_template, extra_stop_ids=stops,
                         strip_leading_space=spm_like and ('"Strip"' in decoder or '"Metaspace"' in decoder))

    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        text = encodable(text)
        self._hf.encode_special_tokens = not parse_special
        ids = library_encode(self._hf, text) if text else []
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def _encode_text(self, text: str, after_special: bool) -> list[int]:
        # one plain-text piece for the base class's special-token splitting (e.g. encode_protected)
        self._hf.encode_special_tokens = True
        return library_encode(self._hf, text)

    def _normal_piece(self, tid: int) -> bytes:
        text = self._tokens[tid]
        if self._byte_level:
            return byte_level_decode(text)
        return text.replace(SPACE, " ").encode("utf-8")


def _template_adds_bos(spec: dict[str, Any], bos: int | None, tokens: list[str]) -> bool:
    """No add_bos_token in the config: BOS is added when the post-processor's template starts with it."""
    post = spec.get("post_processor") or {}
    procs = post.get("processors", [post]) if isinstance(post, dict) else []
    for proc in procs if isinstance(procs, list) else []:
        single = proc.get("single") if isinstance(proc, dict) else None
        first = single[0] if isinstance(single, list) and single else None
        if isinstance(first, dict) and isinstance(first.get("SpecialToken"), dict):
            return bos is not None and 0 <= bos < len(tokens) and first["SpecialToken"].get("id") == tokens[bos]
    return False


class SentencePieceTokenizer(Tokenizer):
    """tokenizer.model, encoded by the `sentencepiece` library (llama.cpp's SPM gives the same ids)."""

    kind = "spm"

    def __init__(self, path: Path, tok_cfg: dict[str, Any], configs: list[dict[str, Any]],
                 chat_template: str | None) -> None:
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise LocalLLMError(f"cannot load {path}: {e}") from None
        sp = self._sp
        tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        types = [_sp_type(sp, i) for i in range(len(tokens))]
        for key, added in _added_tokens(tok_cfg):
            tid, text = check_token_id(key, path.with_name("tokenizer_config.json")), _token_content(added)
            if text is None:
                continue
            if tid >= len(tokens):
                tokens += [""] * (tid + 1 - len(tokens))
                types += [TOKEN_UNUSED] * (tid + 1 - len(types))
            tokens[tid] = text
            if types[tid] in (TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_USER_DEFINED):
                types[tid] = TOKEN_CONTROL if isinstance(added, dict) and added.get("special") else TOKEN_USER_DEFINED
        vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
        bos, eos, stops = _special_ids(vocab, tok_cfg, configs)
        if bos is None and sp.bos_id() >= 0:
            bos = sp.bos_id()
        if eos is None and sp.eos_id() >= 0:
            eos = sp.eos_id()
        add_bos = tok_cfg.get("add_bos_token")
        super().__init__(tokens, types, bos_id=bos, eos_id=eos,
                         add_bos=add_bos if isinstance(add_bos, bool) else True,
                         chat_template=chat_template, extra_stop_ids=stops, strip_leading_space=True)

    def _encode_text(self, text: str, after_special: bool) -> list[int]:
        return self._sp.encode(text)

    def _normal_piece(self, tid: int) -> bytes:
        return self._tokens[tid].replace(SPACE, " ").encode("utf-8")


def check_token_id(value: Any, where: Path) -> int:
    """A token id from a tokenizer file, as int, or one error naming the file."""
    try:
        tid = int(value)
    except (TypeError, ValueError):
        raise LocalLLMError(f"bad token id {value!r} in {where}: expected an integer") from None
    if not 0 <= tid < MAX_VOCAB:
        raise LocalLLMError(f"token id {tid} in {where} is out of range (0 to {MAX_VOCAB - 1})")
    return tid


def _added_tokens(tok_cfg: dict[str, Any]) -> list[tuple[Any, Any]]:
    """tokenizer_config.json's added_tokens_decoder ({"id": {"content": ...}}) as (key, value) pairs."""
    added = tok_cfg.get("added_tokens_decoder") or {}
    if not isinstance(added, dict):
        raise LocalLLMError(f"bad added_tokens_decoder in tokenizer_config.json: {type(added).__name__}, "
                            "expected an object of id -> token")
    return list(added.items())


def _sp_type(sp, i: int) -> int:
    if sp.is_unknown(i):
        return TOKEN_UNKNOWN
    if sp.is_control(i):
        return TOKEN_CONTROL
    if sp.is_byte(i):
        return TOKEN_BYTE
    if sp.is_unused(i):
        return TOKEN_UNUSED
    return TOKEN_NORMAL
