"""Every default of generation lives here; the CLI and the library read these and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.8  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0 disables
    repeat_penalty: float = 1.0  # 1.0 disables (llama.cpp semantics: divide positive logits)
    repeat_last_n: int = 64  # how many recent tokens the penalty looks at (-1: all, 0: none)
    seed: int | None = None  # None: a fresh random seed; else 0 .. 2^64-1


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int = 256  # -1: until an end-of-turn id or the context is full (llama.cpp's -n -1)
    ctx: int = 4096  # KV cache capacity, at least 2; capped at the model's trained context
    stop: tuple[str, ...] = ()  # stop strings (end-of-turn tokens always stop)


@dataclass(frozen=True)
class DraftSettings:
    """Speculative decoding (localllm/speculative.py): a draft model or prompt lookup proposes tokens,
    the target verifies them in one pass."""

    draft: str | None = None  # a model (path or name), or "self:TYPE": the target quantized in memory
    lookup: int = 0  # prompt lookup instead of a draft model: longest n-gram matched (0: off)
    max_draft: int | None = None  # tokens drafted per target pass; None: adaptive (below)
    min_p: float = 0.0  # stop drafting when the draft's softmax gives its token less than this (0: off)
    dtype: str | None = None  # the draft's weights' dtype; None: the device's default (device.py)
    # Adaptive K: K maximises the expected tokens per unit of cost, (1 - a^(K+1)) / ((1 - a)(1 + c K)),
    # for a the recent acceptance rate (a running mean) and c the cost of one drafted token relative to
    # a target pass: for a draft model the weight bytes of its step over the target's (draft.py).
    most_k: int = 16
    start_acceptance: float = 0.8
    acceptance_memory: float = 0.7  # weight of the past in the running mean, per target pass
    lookup_cost: float = 0.05  # prompt lookup: only the verify pass grows with each drafted token
    plain_steps: int = 8  # plain decode steps timed for --verbose's "speedup over plain decoding"


@dataclass(frozen=True)
class CpuSettings:
    threads: int | None = None  # None: the physical cores (kernels.cpu.physical_cores)
    cache_dir: Path = Path.home() / ".cache" / "localllm"  # the built C++ kernels, parsed GGUF headers
    header_cache_min_bytes: int = 1 << 20  # GGUF metadata at least this big is parsed once, then cached
    # the header cache keeps at most this many entries and bytes (the least recently used go first)
    header_cache_max_entries: int = 64
    header_cache_max_bytes: int = 256 << 20


@dataclass(frozen=True)
class FileSettings:
    """Files written whole or not at all (quantize/partial.py)."""

    # a partial file of OUT not written to for this long is a dead writer's, whatever pid it names
    stale_partial_seconds: float = 6 * 3600
    # perplexity --save-logits: "localllm" (exact target log-probs, the tail's mass) or "llama.cpp"
    # (what llama-perplexity --kl-divergence reads; commands/llama_logits.py)
    logits_format: str = "localllm"


@dataclass(frozen=True)
class TemplateSettings:
    """Budget of one chat-template render (template_budget.py): templates are code from the model file."""

    seconds: float = 5.0  # wall clock; real templates render in milliseconds
    max_chars: int = 8_000_000  # the output, and any string or list the template builds
    max_range: int = 100_000  # items of one range() (jinja's sandbox default)
    max_source_chars: int = 200_000  # the template itself (real ones are under 20 KB; parsing is slow)


@dataclass(frozen=True)
class LoaderLimits:
    """What a model file may claim before we believe it (localllm/validate.py, gguf_file.py): generous
    for real models (Llama 3.1 405B: 126 layers, dim 16384, ffn 53248, vocab 128256; Qwen 2.5: 1M
    context), small enough that no claim alone can make us allocate without bound."""

    max_layers: int = 4096
    max_dim: int = 1 << 17  # embedding width, head dim x heads
    max_ffn_dim: int = 1 << 20
    max_heads: int = 1 << 12
    max_vocab: int = 1 << 24
    max_context: int = 1 << 24
    max_metadata_array: int = 1 << 24  # values in one GGUF metadata array (a vocabulary's tokens, merges)
    max_dims: int = 4  # GGML_MAX_DIMS: dimensions of one tensor


@dataclass(frozen=True)
class ServeSettings:
    """`localllm serve` (localllm/server/, localllm/engine.py). Sampling defaults are SamplingSettings'
    (llama-server's); a request's own values override them."""

    host: str = "127.0.0.1"  # localhost only unless asked
    port: int = 8080
    parallel: int = 4  # sequences decoded together (slots), each with its own --ctx rows of KV cache
    max_queue: int = 64  # requests waiting for a slot; one more is refused with 503 + Retry-After
    # prompt ids prefilled per engine step (the waiting prompts admitted together in one prefill_slots
    # pass, then one decode step of the running streams); a longer prompt is prefilled in parts. 512 on
    # an H100 (8B, 16 clients) gave no better TTFT p50 and fewer tokens/s (docs/PERFORMANCE.md)
    prefill_tokens: int = 2048
    # ... where a prompt's cost grows with its ids even in one pass (the CPU backends: Runtime.
    # prompts_compute_bound): a 16-prompt pass there hands out every first token after ~16 prefills, so
    # TTFT p50 at 16 clients doubled against one prompt a step (docs/PERFORMANCE.md): about one prompt a pass
    prefill_tokens_compute_bound: int = 64
    # a prompt sharing this many more ids with another admitted in the same pass than its slot holds
    # waits for a second pass that copies that prefix's rows (about what one more pass costs, in ids)
    prefill_share_min: int = 8
    retry_after_seconds: int = 1
    max_tokens: int = -1  # a request without max_tokens: until an end-of-turn id or its slot's context is full
    max_top_logprobs: int = 20  # OpenAI's limit on top_logprobs (chat); completions' logprobs: at most 5
    max_stop_strings: int = 4  # OpenAI's limit on `stop`
    idle_wait_seconds: float = 0.5  # a non-streaming request checks this often whether its client left
    shutdown_seconds: float = 5.0  # Ctrl-C / SIGTERM: in-flight streams get this long to end
    # --draft / --lookup: a step is a speculative round only while at most this many slots decode (more
    # rows already share each weight read; drafts then cost more than they save: docs/PERFORMANCE.md)
    speculate_max_slots: int = 4
    # where decode steps are asynchronous (CUDA), a step of at least this many rows launches the next
    # one before handing out its events (engine.py, "running ahead"): at 64 rows those events took ~2 ms
    # of a ~10 ms step (8B, H200: tokens/s at 64 clients 1.21-1.22x); below, the gain is small and a
    # request arriving meanwhile waits for the launched step before its prefill (TTFT p50 at 16 clients
    # ~10 ms longer: docs/PERFORMANCE.md, fifteenth session)
    run_ahead_rows: int = 32


@dataclass(frozen=True)
class ParallelSettings:
    """Tensor parallelism (issue 23; commands/tp_cmd.py)."""

    tp: int = 1  # --tp: ranks the model is split over (1: one process, the whole model)


@dataclass(frozen=True)
class GpuSettings:
    """CUDA (localllm/backends/cuda.py)."""

    # Prompt products on quantized weights decode each weight to the activation dtype and multiply
    # (cuBLAS): the decode is ~40% of a product's time (docs/PERFORMANCE.md). At the first prompt the
    # runtime keeps those decoded copies (the same values: the same products, bit for bit) when all of
    # them fit in this share of the GPU memory then free (after the model and its KV cache); 0: never.
    # An 8B model's are ~14 GB in bf16: kept on an 80 GB card, not on a 24 GB one.
    dense_prompt_share: float = 0.5
    # Decode steps of at least this many slots (serve's continuous batching: buckets of 32, 64 rows)
    # multiply dense values through cuBLAS, in one pass, where every layer weight has them (a dense
    # model's own, or the decoded copies above): there the batch-invariant integer kernels are bound
    # by their per-row work, not the weights' bytes (docs/PERFORMANCE.md). A row's bits then depend on
    # how many slots share its step; smaller steps keep them (each slot decodes as it would alone:
    # serve's 16 concurrent greedy streams equal each served alone). 0: never.
    dense_decode_rows: int = 32


DEFAULT_SAMPLING = SamplingSettings()
DEFAULT_GENERATION = GenerationSettings()
DEFAULT_DRAFT = DraftSettings()
DEFAULT_CPU = CpuSettings()
DEFAULT_TEMPLATE = TemplateSettings()
DEFAULT_FILES = FileSettings()
DEFAULT_LIMITS = LoaderLimits()
DEFAULT_SERVE = ServeSettings()
DEFAULT_PARALLEL = ParallelSettings()
DEFAULT_GPU = GpuSettings()

# Seconds between the elapsed-time lines a long silent step (the first C++ kernel build, a first GGUF
# parse) prints on a non-terminal stderr (a pipe, a CI log), where no spinner is drawn (progress.py).
PROGRESS_LINE_SECONDS = 10.0

# On CUDA the first tokens of a process compile and load the Triton kernels and capture the decode graph
# (11 s on a fresh H100 machine, ~1.5 s with warm caches: docs/PERFORMANCE.md): generation awaiting its
# first FIRST_PIECES pieces for longer than FIRST_TOKENS_SPINNER_DELAY seconds shows a spinner (progress.py)
FIRST_PIECES = 2
FIRST_TOKENS_SPINNER_DELAY = 2.0
