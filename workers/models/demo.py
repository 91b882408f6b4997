"""The built-in demo model: a small random-weight Llama with a real byte-level BPE tokenizer.

With no model configured the server serves this, so it starts anywhere without downloads. The
model directory is an ordinary Hugging Face Llama checkpoint (transformers can load it too):
`config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, plus `mindie_demo.json` recording the parameters it was built from.

Everything is deterministic: weights come from a seeded torch.Generator and the tokenizer is
trained on a corpus drawn from a seeded `random.Random`, so two machines build byte-identical
files (for the same torch/tokenizers versions). Generation takes a few seconds (mostly tokenizer
training) and is cached; the cache is filled atomically (build in a temp dir, then rename) so
concurrent processes can race safely.

Command line: `mindie-demo-model --help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DemoSize", "PRESETS", "VOCAB_SIZE", "default_cache_dir", "demo_model_dir", "ensure_demo_model", "main"]

log = logging.getLogger("workers.models")

VOCAB_SIZE = 32000
UNK, BOS, EOS = 0, 1, 2
# Bump when the generated files change for the same parameters, so stale caches are not reused.
FORMAT_VERSION = 1
_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_MARKER = "mindie_demo.json"


@dataclass(frozen=True)
class DemoSize:
    """Shape of the generated model. The vocabulary is always the 32000-token demo tokenizer."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    tie_word_embeddings: bool = True
    seed: int = 0

    def validate(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"demo model: {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"demo model: hidden ({self.hidden}) must be a multiple of heads ({self.heads}) "
                             "with an even head size")
        if self.heads % self.kv_heads:
            raise ValueError(f"demo model: kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"demo model: dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


PRESETS: dict[str, DemoSize] = {
    # ~11M parameters (8.2M of them the tied embedding); loads in a fraction of a second.
    "demo": DemoSize(),
    # Benchmark model of the engine issue: hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 32000;
    # ~31M parameters (16.4M tied embedding + 14.8M in 8 layers with intermediate 688).
    "bench30m": DemoSize(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=688),
    # GPU decode figures (mindie_bench/lab/gpu_check.sh): Llama-3.2-1B's shape with the demo vocabulary,
    # ~1.04B parameters in bf16 (2.1 GB).
    "gpu1b": DemoSize(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, dtype="bfloat16"),
}


def default_cache_dir() -> Path:
    """`$MINDIE_CACHE_DIR`, else `~/.cache/mindie-py`."""
    env = os.environ.get("MINDIE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mindie-py"


def _size_from(size: dict[str, Any]) -> DemoSize:
    fields = {f.name for f in dataclasses.fields(DemoSize)}
    unknown = sorted(set(size) - fields)
    if unknown:
        raise TypeError(f"unknown demo model parameter(s) {unknown} (known: {sorted(fields)})")
    s = DemoSize(**size)
    s.validate()
    return s


def _fingerprint(size: DemoSize) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "vocab_size": VOCAB_SIZE, **dataclasses.asdict(size)}


def demo_model_dir(cache_dir: str | Path | None = None, **size: Any) -> Path:
    """Where `ensure_demo_model` keeps a model of this size: `<cache_dir>/demo-<hash of the parameters>`."""
    s = _size_from(size)
    digest = hashlib.sha256(json.dumps(_fingerprint(s), sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / f"demo-{digest}"


def ensure_demo_model(cache_dir: str | Path | None = None, *, out: str | Path | None = None, **size: Any) -> Path:
    """Return the directory of the demo model with these parameters, generating it on first use.

    `size` takes the fields of `DemoSize` (hidden, layers, heads, kv_heads, intermediate,
    max_position_embeddings, dtype, tie_word_embeddings, seed). The model lives in
    `demo_model_dir(cache_dir, **size)`, or exactly in `out` when given. Safe when several
    processes call it at once: each builds in a private temp dir and the first rename wins.
    """
    s = _size_from(size)
    final = Path(out).expanduser() if out is not None else demo_model_dir(cache_dir, **size)
    if final.exists() and any(final.iterdir()):
        if _is_complete(final, s):  # also covers losing a race: the winner's rename is atomic
            return final
        raise FileExistsError(f"{final} exists but is not a complete demo model with these parameters; "
                              "remove it or choose another directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        t0 = time.monotonic()
        log.info("generating demo model (%s) in %s", ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(s).items()), final)
        _write_model(tmp, s)
        # mkdtemp makes the dir 0700 (and safetensors writes 0600); the model is not secret.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            if final.exists():
                final.rmdir()  # an empty directory (e.g. created by the operator for --out) we may replace
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (rename onto a non-empty dir fails); use its copy.
            if not _is_complete(final, s):
                raise
            log.info("demo model already generated by another process: %s", final)
        else:
            log.info("demo model ready in %.1fs: %s", time.monotonic() - t0, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_stale_temp_dirs(final: Path, max_age_s: float = 3600.0) -> None:
    """Delete temp dirs left by generations that were killed (a live one finishes in seconds)."""
    now = time.time()
    for d in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            if now - d.stat().st_mtime > max_age_s:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _is_complete(path: Path, size: DemoSize) -> bool:
    marker = path / _MARKER
    if not marker.is_file() or not all((path / f).is_file() for f in _FILES):
        return False
    try:
        return json.loads(marker.read_text(encoding="utf-8")) == _fingerprint(size)
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------- generation


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_model(d: Path, s: DemoSize) -> None:
    head_dim = s.hidden // s.heads
    _write_json(d / "config.json", {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": s.tie_word_embeddings,
        "torch_dtype": s.dtype,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": None,
        "initializer_range": 0.02,
        "use_cache": True,
    })
    _write_json(d / "generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": None})
    t0 = time.monotonic()
    _write_weights(d / "model.safetensors", s)
    log.info("wrote random weights (seed %d) in %.2fs", s.seed, time.monotonic() - t0)
    t0 = time.monotonic()
    _write_tokenizer(d, s.max_position_embeddings)
    log.info("trained %d-token byte-level BPE tokenizer in %.2fs", VOCAB_SIZE, time.monotonic() - t0)
    _write_json(d / _MARKER, _fingerprint(s))


def _write_weights(path: Path, s: DemoSize) -> None:
    import torch
    from safetensors.torch import save_file

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[s.dtype]
    head_dim = s.hidden // s.heads
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB_SIZE, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (s.heads * head_dim, s.hidden)),
            (p + "self_attn.k_proj.weight", (s.kv_heads * head_dim, s.hidden)),
            (p + "self_attn.v_proj.weight", (s.kv_heads * head_dim, s.hidden)),
            (p + "self_attn.o_proj.weight", (s.hidden, s.heads * head_dim)),
            (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.down_proj.weight", (s.hidden, s.intermediate)),
            (p + "input_layernorm.weight", (s.hidden,)),
            (p + "post_attention_layernorm.weight", (s.hidden,)),
        ]
    shapes.append(("model.norm.weight", (s.hidden,)))
    if not s.tie_word_embeddings:
        shapes.append(("lm_head.weight", (VOCAB_SIZE, s.hidden)))

    # One generator drawn in a fixed order: the same seed gives the same bytes on every run.
    gen = torch.Generator(device="cpu").manual_seed(s.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        if len(shape) == 1:  # norm weights start at 1, as in transformers' init
            t = torch.ones(shape)
        else:
            t = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        tensors[name] = t.to(dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---------------------------------------------------------------------------- tokenizer

# Frequent English words so ordinary English text gets whole-word tokens.
_COMMON = """the of and to in a is that for it as was with be by on not he I this are or his from at
which but have an they you were her she there had been one all we can their has more if will would
about so no what up out said when who may them some could into only time then its also two first
new other people my than like over any now did very way these man just how our day us your after
most made because work well back good where much through before long should world year still
own see men here must same go under know last might great while old life never make those both
between off home each being right little under again down place think three take say small
found house every hello thank please yes name city water food today language model answer
question server token text data number word example French English native speaker looking job
hospitality industry am Hello The It In We You This What How""".split()


def _synthetic_corpus(seed: int = 1234, n_lines: int = 30000) -> list[str]:
    """Random sentences mixing English words, pseudo-words in several scripts, digits and emoji.

    The mix makes the tokenizer learn Latin, accented, Cyrillic, Greek and CJK pieces; anything it
    never saw still encodes through the 256 byte tokens.
    """
    rng = random.Random(seed)
    cons, vows, acc = "bcdfghjklmnprstvwz", "aeiou", "éèàüöñçåø"
    cyr_c, cyr_v = "бвгдклмнпрстфхцчш", "аеиоуыя"
    greek = "αβγδεζηθικλμνξοπρστυφχψω"
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 600)]
    kana = [chr(c) for c in range(0x3041, 0x3094)]
    emoji = [chr(c) for c in range(0x1F600, 0x1F64F)]

    def word() -> str:
        r = rng.random()
        if r < 0.35:
            return rng.choice(_COMMON)
        if r < 0.70:
            v = vows + (acc if rng.random() < 0.1 else "")
            w = "".join(rng.choice(cons) + rng.choice(v) for _ in range(rng.randint(1, 4)))
            return w.capitalize() if rng.random() < 0.1 else w
        if r < 0.80:
            return "".join(rng.choice(cyr_c) + rng.choice(cyr_v) for _ in range(rng.randint(1, 3)))
        if r < 0.85:
            return "".join(rng.choice(greek) for _ in range(rng.randint(2, 6)))
        if r < 0.93:
            return "".join(rng.choice(cjk) for _ in range(rng.randint(1, 3)))
        if r < 0.96:
            return "".join(rng.choice(kana) for _ in range(rng.randint(2, 4)))
        if r < 0.98:
            return str(rng.randint(0, 99999))
        return rng.choice(emoji)

    return [" ".join(word() for _ in range(rng.randint(4, 16))) + rng.choice(".,!?;:") for _ in range(n_lines)]


def build_tokenizer() -> Any:
    """Train the demo byte-level BPE tokenizer (`tokenizers.Tokenizer`, vocab exactly 32000)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=["<unk>", "<s>", "</s>"],  # ids 0, 1, 2 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"demo tokenizer came out with {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    # Like Llama: encode() prepends <s>; ByteLevel keeps offsets right for the byte mapping.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]),
    ])
    return tok


def _write_tokenizer(d: Path, max_len: int) -> None:
    tok = build_tokenizer()
    tok.save(str(d / "tokenizer.json"))
    special = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
               for i, c in ((UNK, "<unk>"), (BOS, "<s>"), (EOS, "</s>"))}
    _write_json(d / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": special,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        # Zephyr-style text template; no BOS in it because the tokenizer already prepends one.
        "chat_template": (
            "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        ),
    })


# ---------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """`mindie-demo-model`: generate (or find in the cache) the demo model and print its directory."""
    parser = argparse.ArgumentParser(
        prog="mindie-demo-model",
        description="Generate the built-in demo model: a random-weight Llama checkpoint with a real "
                    "32000-token byte-level BPE tokenizer, in Hugging Face format. Deterministic: the "
                    "same parameters always give the same files. Without --out it is cached under "
                    "$MINDIE_CACHE_DIR (default ~/.cache/mindie-py) in demo-<hash>/ and reused. "
                    "Prints the model directory on stdout; progress goes to stderr.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                        help="starting size: 'demo' (hidden 256, 4 layers, ~11M params, the server default) "
                             "or 'bench30m' (hidden 512, 8 layers, 8 heads, 4 KV heads, for benchmarks); "
                             "the options below override it (default: demo)")
    parser.add_argument("--out", metavar="DIR", help="write the model into exactly this directory "
                        "(must not exist or be empty) instead of the cache")
    parser.add_argument("--cache-dir", metavar="DIR", help="cache root (default: $MINDIE_CACHE_DIR or ~/.cache/mindie-py)")
    parser.add_argument("--hidden", type=int, metavar="N", help="hidden size")
    parser.add_argument("--layers", type=int, metavar="N", help="number of decoder layers")
    parser.add_argument("--heads", type=int, metavar="N", help="attention heads (must divide --hidden)")
    parser.add_argument("--kv-heads", type=int, metavar="N", help="key/value heads for GQA (must divide --heads)")
    parser.add_argument("--intermediate", type=int, metavar="N", help="MLP intermediate size")
    parser.add_argument("--max-position-embeddings", type=int, metavar="N", help="longest supported sequence")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="dtype stored in the file")
    parser.add_argument("--seed", type=int, help="weight initialisation seed")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    ns = parser.parse_args(argv)

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING if ns.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    size = dataclasses.asdict(PRESETS[ns.preset])
    for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_position_embeddings", "dtype", "seed"):
        if getattr(ns, key) is not None:
            size[key] = getattr(ns, key)
    try:
        path = ensure_demo_model(ns.cache_dir, out=ns.out, **size)
    except (ValueError, FileExistsError, OSError) as exc:
        print(f"mindie-demo-model: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
